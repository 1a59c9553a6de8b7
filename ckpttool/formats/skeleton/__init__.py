"""The pickle skeletons of the scale readers, walked opcode by opcode.

A DCP ``.metadata`` of thousands of ranks and a ShardedTensor rank file's every-rank shard
metadata are millions of regular entries. Rebuilding them as objects would take gigabytes;
these walkers read the pickle a window at a time, match its long runs of regular entries
as regex steps and keep them as records (:mod:`ckpttool.formats.records`).

==================  ===========================================================================
``opcodes``         the opcodes by name, derived from ``pickletools.opcodes`` and checked
                    against it at import; their stack effects; the int runs and the value cache
``metadata_runs``   a DCP ``.metadata`` (``ChunkRun``, ``StorageRun``)
``shard_runs``      a ShardedTensor rank file's ``data.pkl`` (``ShardRun``)
==================  ===========================================================================

Each walk reads only what its spec of a run allows and hands anything else to the full
restricted unpickler: a skeleton never decides a verdict the whole file would not.
"""
