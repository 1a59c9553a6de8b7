"""Row gathers: a tensor made of rows of another, as byte ranges of the source.

The RoPE permutation between Meta's layout (torchtitan, the original Llama weights: a
head's rotary pairs interleaved, rows ``2i`` and ``2i + 1``) and Hugging Face's (each
head's pairs split into halves) moves whole rows: HF row ``h*hd + p*hd/2 + i`` is Meta
row ``h*hd + 2i + p``. So the HF tensor is, for each head and half, a strided run of
source rows: one shard of a :class:`~ckpttool.tree.ShardedRef` whose block is a view of
the stored tensor (its rows every other one), never the tensor in memory at plan time.
A source split along its first dimension (FSDP, DCP chunks) gives a block for each
part of a run that lies in one of its shards.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from ..errors import CkptError
from ..tree import Leaf, Shard, ShardedRef, TensorRef, strided_rows


@dataclass(frozen=True, eq=False)
class RowsOf:
    """Rows ``start, start + step, ...`` (``count`` of them) of a stored block of rows:
    a :class:`~ckpttool.tree.leaves.Block` (metadata only; the view of its stored
    tensor is made when asked for)."""

    block: Any
    start: int
    step: int
    count: int

    @property
    def cast_to(self) -> Any:
        return self.block.cast_to

    def tensor_ref(self) -> TensorRef:
        return strided_rows(self.block.tensor_ref(), self.start, self.step, self.count)

    def where(self) -> str:
        """The block's place for a plan's digest (as the blocks it views name theirs)."""
        inner = getattr(self.block, "where", None)
        named = inner() if callable(inner) else repr(self.block.tensor_ref().storage)
        return f"{named} rows {self.start}+{self.step}x{self.count}"


@dataclass(frozen=True, eq=False)
class IndexOf:
    """Index ``index`` of a stored block's leading axis (one layer of a tensor stacked
    along a layer axis, as megatron-core's ``torch_dist`` saves a layer's weights)."""

    block: Any
    index: int

    @property
    def cast_to(self) -> Any:
        return self.block.cast_to

    def tensor_ref(self) -> TensorRef:
        ref = self.block.tensor_ref()
        return TensorRef(
            ref.dtype,
            tuple(ref.shape[1:]),
            tuple(ref.stride[1:]),
            ref.offset + self.index * ref.stride[0],
            ref.storage,
            device=ref.device,
        )

    def where(self) -> str:
        inner = getattr(self.block, "where", None)
        named = inner() if callable(inner) else repr(self.block.tensor_ref().storage)
        return f"{named} index {self.index}"


def layer_of(leaf: Leaf, index: int, name: str) -> Leaf:
    """``leaf[index]`` of a tensor stacked along its first axis, as a view of the stored
    bytes (a stored tensor's view, or the shards that hold that index).

    Raises:
        CkptError: No such index, or an incomplete sharded tensor (named).
    """
    if not leaf.shape or not 0 <= index < leaf.shape[0]:
        raise CkptError(f"tensor {name!r} {list(leaf.shape)} has no index {index} to unstack")
    if isinstance(leaf, TensorRef):
        return IndexOf(leaf, index).tensor_ref()
    if isinstance(leaf, ShardedRef):
        if leaf.incomplete:
            raise CkptError(f"sharded tensor {leaf.incomplete}")
        shards = [
            Shard(tuple(s.offsets[1:]), tuple(s.sizes[1:]), IndexOf(s.tensor, index - s.offsets[0]))
            for s in leaf.shards
            if s.offsets[0] <= index < s.offsets[0] + s.sizes[0]
        ]
        return ShardedRef(leaf.dtype, tuple(leaf.shape[1:]), shards, kind="rows")
    raise CkptError(f"tensor {name!r} is not a dense tensor: it cannot be unstacked")


def gather_rows(leaf: Leaf, runs: list[tuple[int, int]], name: str) -> ShardedRef:
    """The tensor made of the row runs ``(source row, count)`` of ``leaf``, one after the
    other: each run a view of the stored rows (split where the source's shards split).

    Raises:
        CkptError: A run past the source's rows, or a source split along its columns.
    """
    rows, *rest = leaf.shape if leaf.shape else (0,)
    blocks = _row_blocks(leaf, name)
    shards, out_row = [], 0
    for src_row, count in runs:
        if src_row < 0 or src_row + count > rows:
            raise CkptError(f"tensor {name!r}: rows {src_row}..{src_row + count} of {rows}")
        for block_start, block, block_rows in blocks:
            first = max(src_row, block_start)
            last = min(src_row + count, block_start + block_rows)
            if first < last:
                view = RowsOf(block, first - block_start, 1, last - first)
                at = out_row + first - src_row
                shards.append(Shard((at, *(0 for _ in rest)), (last - first, *rest), view))
        out_row += count
    return ShardedRef(leaf.dtype, (out_row, *rest), shards, kind="rows")


def rope_to_hf(leaf: Leaf, heads: int, name: str) -> ShardedRef:
    """``leaf`` (a q or k projection in Meta's interleaved layout, ``heads`` heads) in
    Hugging Face's layout: what ``transformers``' ``convert_llama_weights_to_hf``'s
    ``permute`` and torchtitan's ``Llama3StateDictAdapter._permute`` compute.

    Raises:
        CkptError: Rows that do not divide into ``heads`` heads of even size, or a
            source split along another dimension than its rows.
    """
    rows, *rest = leaf.shape if len(leaf.shape) >= 1 else (0,)
    if heads <= 0 or rows % heads or (rows // heads) % 2:
        raise CkptError(f"tensor {name!r}: {rows} rows are not {heads} heads of an even head size")
    head_dim = rows // heads
    half = head_dim // 2
    runs = [  # (output row, source row, count): each head's even rows, then its odd ones
        (h * head_dim + p * half, h * head_dim + p, half) for h in range(heads) for p in (0, 1)
    ]
    shards = []
    for out_row, src_row, count in runs:
        for block_start, block, block_rows in _row_blocks(leaf, name):
            # the source rows src_row + 2k that lie in [block_start, block_start + block_rows)
            first = max(0, -(-(block_start - src_row) // 2))
            last = min(count, -(-(block_start + block_rows - src_row) // 2))
            if first >= last:
                continue
            view = RowsOf(block, src_row + 2 * first - block_start, 2, last - first)
            shards.append(Shard((out_row + first, *(0 for _ in rest)), (last - first, *rest), view))
    return ShardedRef(leaf.dtype, tuple(leaf.shape), shards, kind="rows")


def rope_from_hf_rows(leaf: Leaf, heads: int, name: str) -> ShardedRef:
    """The inverse of :func:`rope_to_hf` as a row gather (Hugging Face's halves back to
    Meta's interleaved pairs, torchtitan's ``_reverse_permute``): Meta row
    ``h*hd + 2i + p`` is HF row ``h*hd + p*hd/2 + i``. Consecutive rows come from two
    runs, so each row is a shard of its own (its bytes still a range of the source).

    Raises:
        CkptError: As :func:`rope_to_hf`.
    """
    rows, *rest = leaf.shape
    if heads <= 0 or rows % heads or (rows // heads) % 2:
        raise CkptError(f"tensor {name!r}: {rows} rows are not {heads} heads of an even head size")
    head_dim = rows // heads
    half = head_dim // 2
    blocks = _row_blocks(leaf, name)
    starts = [b[0] for b in blocks]
    shards = []
    for out_row in range(rows):
        h, within = divmod(out_row, head_dim)
        i, p = divmod(within, 2)
        src_row = h * head_dim + p * half + i
        k = bisect.bisect_right(starts, src_row) - 1
        block_start, block, _ = blocks[k]
        view = RowsOf(block, src_row - block_start, 1, 1)
        shards.append(Shard((out_row, *(0 for _ in rest)), (1, *rest), view))
    return ShardedRef(leaf.dtype, tuple(leaf.shape), shards, kind="rows")


def _row_blocks(leaf: Leaf, name: str) -> list[tuple[int, Any, int]]:
    """(first row, block, rows) of each stored block of whole rows of ``leaf``."""
    if isinstance(leaf, TensorRef):
        return [(0, leaf, leaf.shape[0])]
    if isinstance(leaf, ShardedRef):
        if leaf.incomplete:
            raise CkptError(f"sharded tensor {leaf.incomplete}")
        blocks = []
        for shard in leaf.shards:
            if any(o != 0 for o in shard.offsets[1:]) or tuple(shard.sizes[1:]) != tuple(
                leaf.shape[1:]
            ):
                raise CkptError(
                    f"tensor {name!r} is split along its columns (a shard at "
                    f"{list(shard.offsets)}): its rows cannot be gathered as stored"
                )
            blocks.append((shard.offsets[0], shard.tensor, shard.sizes[0]))
        return sorted(blocks, key=lambda b: b[0])
    raise CkptError(f"tensor {name!r} is not a dense tensor: its rows cannot be gathered")


def rope_from_hf(tensor: Any, heads: int) -> Any:
    """The inverse of :func:`rope_to_hf` on a ``torch.Tensor`` (Hugging Face's layout back
    to Meta's): torchtitan's ``_reverse_permute``."""
    rows, cols = tensor.shape[0], tensor.shape[1] if tensor.dim() > 1 else 1
    head_dim = rows // heads
    return tensor.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(tensor.shape)
