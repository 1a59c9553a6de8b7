"""``-o s3://bucket/prefix/...``: an output written as S3 multipart uploads.

Every output file is one multipart upload; its parts are byte ranges of the writer's
plan (:mod:`ckpttool.targets.s3_parts`), uploaded side by side from a few part-sized
buffers as the plan is written: no local file, memory bounded. Nothing is visible
under a final key until every part of every file is in: then the data files are
completed, the index (``model.safetensors.index.json``, DCP's ``.metadata``) last, so
a visible index means visible shards. Each completed object is checked (size, ETag).

Resumable: a small journal object beside the output (``.NAME.ckpttool-upload.json``,
or ``.ckpttool-upload.json`` inside a folder output) holds the plan's digest (the
plan's layout, the inputs' identities, the part sizes) and the upload ids. A rerun of
the same command finds it, lists the parts already there (ListParts) and uploads only
the others; a rerun with another plan (an input changed, other options) aborts the
earlier uploads first. A failure that a rerun cannot mend (bad input, a store that
answers wrong ETags) aborts the uploads; one that it can (the network, after the
retries) leaves them, and says so. A killed process leaves them for the rerun too
(a bucket lifecycle rule ``AbortIncompleteMultipartUpload`` cleans what is never rerun).

``--force`` as for local outputs: an existing object is refused without it; with it
only what a ckpttool output consists of is replaced (a checkpoint object; the shards
and index of a folder output, never other objects under the prefix).

Several processes: :func:`prepare` (one process: checks, journal, uploads created),
:func:`upload_run` (any process holding the :class:`Session`: its parts), then
:func:`finish` (one process: every part checked, objects completed, index last).
:func:`write` does all three in one process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .. import sources
from ..errors import CkptError, OutputExistsError, UsageError
from ..progress import Progress
from ..writers import FilePlan, FolderLayout, Plan
from .outcome import Outcome
from .s3_client import (
    PartDone,
    S3Uploads,
    UploadFailed,
    env_part_size,
    md5_etag,
    multipart_etag,
    split_url,
)
from .s3_parts import RunResult, part_count, part_range, part_size_for, write_parts

WRITABLE = ("s3", "s3a")
# what writing elsewhere would need, for the refusal
MISSING = {
    "gs": "Google Cloud Storage would need composite uploads (gcsfs offers no multipart API)",
    "gcs": "Google Cloud Storage would need composite uploads (gcsfs offers no multipart API)",
    "az": "Azure would need staged block lists (adlfs exposes none)",
    "abfs": "Azure would need staged block lists (adlfs exposes none)",
    "abfss": "Azure would need staged block lists (adlfs exposes none)",
}
JOURNAL_VERSION = 1
JOURNAL_NAME = ".ckpttool-upload.json"
COMPLETE_THREADS = 8
JOURNAL_EVERY_S = 10.0  # the CRCs computed go into the journal this often


def check_writable(out: str) -> None:
    """Refuse an output URL that cannot be written with S3's guarantees.

    Raises:
        UsageError: Not ``s3://bucket/...``.
    """
    scheme = sources.scheme_of(out) or ""
    shown = sources.shown(out)
    if scheme in WRITABLE:
        bucket, _ = split_url(out)
        if not bucket:
            raise UsageError("an s3:// output needs a bucket", path=shown)
        return
    why = MISSING.get(scheme, f"{scheme}:// has no atomic multipart upload")
    raise UsageError(
        f"cannot write the output there: ckpttool writes s3:// URLs only; {why}",
        path=shown,
        hint="write to s3:// or a local -o",
    )


def output_url(out: str, default_name: str, *, folder_output: bool) -> str:
    """Where ``-o URL`` puts the output: as :func:`ckpttool.targets.local.output_path` does for
    local paths (``URL/``, or a prefix that holds objects, means into it)."""
    check_writable(out)
    if folder_output:
        return out.rstrip("/")
    if out.endswith("/"):
        return out + default_name
    bucket, key = split_url(out)
    store = S3Uploads(sources.scheme_of(out) or "s3")
    if not key or (store.head(bucket, key) is None and store.has_children(bucket, key)):
        return f"{out.rstrip('/')}/{default_name}"
    return out


def check_inputs(out: str, inputs: Sequence[str], layout: FolderLayout | None) -> None:
    """Refuse an output that would replace or write into an input.

    Raises:
        CkptError: It would.
    """
    check_writable(out)
    mine = _bare(out)
    for path in inputs:
        if sources.scheme_of(path) not in WRITABLE:
            continue
        theirs = _bare(path)
        inside = theirs.startswith(mine + "/")
        if layout is not None and inside:  # into a folder: only its own names are replaced
            inside = "/" not in theirs[len(mine) + 1 :] and layout.owns(theirs.rsplit("/", 1)[1])
        if theirs == mine or mine.startswith(theirs + "/") or inside:
            raise CkptError(
                "output would overwrite the input",
                path=sources.shown(out),
                hint="choose another -o",
            )


def _bare(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


# ---------------------------------------------------------------- the session


@dataclass
class FileUpload:
    """One output file's upload.

    Attributes:
        name: The plan's file name ("" for a single-file output).
        key: Its final key.
        size: Its planned size.
        part_size: Bytes per part.
        upload_id: The multipart upload's id.
        etag: The completed object's ETag, once every part is in (a rerun that finds
            the object with it knows the earlier run completed it).
    """

    name: str
    key: str
    size: int
    part_size: int
    upload_id: str
    etag: str | None = None

    @property
    def parts(self) -> int:
        return part_count(self.size, self.part_size)


@dataclass
class Session:
    """Everything a process needs to upload parts of an output (the journal's content;
    JSON through :meth:`to_json` / :meth:`from_json`, e.g. broadcast to other ranks)."""

    scheme: str
    bucket: str
    journal_key: str
    digest: str
    files: list[FileUpload]
    folder: str | None = None  # the prefix of a folder output
    replaced: list[str] = field(default_factory=list)  # owned names --force replaces
    # CRCs computed of the pieces of each file, by offset (JSON: strings): a rerun
    # needs not read those tensors again for a zip's CRC fields
    crcs: dict[str, dict[str, int]] = field(default_factory=dict)

    def file(self, name: str) -> FileUpload:
        for upload in self.files:
            if upload.name == name:
                return upload
        raise KeyError(name)

    def to_json(self) -> str:
        return json.dumps({"version": JOURNAL_VERSION, **dataclasses.asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> Session:
        doc = json.loads(text)
        if doc.pop("version", None) != JOURNAL_VERSION:
            raise ValueError("not a journal of this version")
        doc["files"] = [FileUpload(**f) for f in doc["files"]]
        return cls(**doc)

    def store(self) -> S3Uploads:
        return S3Uploads(self.scheme)

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    def upload_ids(self) -> str:
        ids = [f"{f.key} (upload {f.upload_id})" for f in self.files]
        return ", ".join(ids[:2]) + (f" and {len(ids) - 2} more" if len(ids) > 2 else "")


def plan_digest(plan: Plan, identities: Sequence[Hashable], part_sizes: Sequence[int]) -> str:
    """What a rerun must match to reuse the uploads: the plan's layout (every piece's
    place and kind, the known bytes' hash), the inputs' identities, the part sizes."""
    digest = hashlib.sha256()
    digest.update(repr([repr(i) for i in identities]).encode())
    for file, part_size in zip(plan.files, part_sizes, strict=True):
        digest.update(f"\0{file.name}\0{file.size}\0{part_size}".encode())
        for piece in file.pieces:
            kind = "data" if piece.data is not None else "build" if piece.build else "leaf"
            cast = piece.cast.name if piece.cast is not None else ""
            digest.update(f"{piece.offset},{piece.nbytes},{kind},{cast},{piece.crc};".encode())
            if piece.data is not None:
                digest.update(hashlib.sha256(piece.data).digest())
    return digest.hexdigest()


def prepare(
    plan: Plan,
    url: str,
    *,
    layout: FolderLayout | None,
    force: bool,
    identities: Sequence[Hashable],
    part_size: int | None = None,
) -> Session:
    """Check the target, find an earlier run's uploads or start new ones, write the journal.

    One process calls it; the others get the :class:`Session` it returns (or read the
    journal: :func:`load_session`).

    Raises:
        OutputExistsError: An object is there and not ``force``.
        CkptError: ``force`` would replace what is not a checkpoint output.
    """
    scheme = sources.scheme_of(url) or "s3"
    bucket, key = split_url(url)
    store = S3Uploads(scheme)
    folder = key if layout is not None else None
    keys = [_join(key, f.name) if f.name else key for f in plan.files]
    sizes = [part_size_for(f.size, part_size or env_part_size()) for f in plan.files]
    digest = plan_digest(plan, identities, sizes)
    journal_key = _join(key, JOURNAL_NAME) if folder is not None else _hidden(key)
    earlier = _load(store, bucket, journal_key)
    now = zip(keys, plan.files, sizes, strict=True)
    layout_now = [(k, f.name, f.size, size) for k, f, size in now]
    if earlier is not None and (
        earlier.digest != digest
        or [(f.key, f.name, f.size, f.part_size) for f in earlier.files] != layout_now
        or (earlier.scheme, earlier.bucket, earlier.folder) != (scheme, bucket, folder)
    ):
        abandon(earlier)  # another plan: its uploads can never be completed
        earlier = None
    done = set()
    if earlier is not None:
        for upload in earlier.files:
            if store.list_parts(bucket, upload.key, upload.upload_id) is not None:
                continue
            if upload.etag and store.head(bucket, upload.key) == (upload.size, upload.etag):
                done.add(upload.key)  # completed by the earlier run
            else:  # gone (aborted by hand, or expired): a new one
                upload.upload_id = store.create(bucket, upload.key)
                upload.etag = None
    replaced = _check_existing(store, bucket, keys, folder, layout, force, done, scheme)
    if earlier is not None:
        session = earlier
        session.replaced = sorted(set(session.replaced) | set(replaced))
    else:
        files = []
        for file, file_key, size in zip(plan.files, keys, sizes, strict=True):
            files.append(FileUpload(file.name, file_key, file.size, size, ""))
        session = Session(scheme, bucket, journal_key, digest, files, folder, replaced)
        try:
            for upload in files:
                upload.upload_id = store.create(bucket, upload.key)
        except BaseException:
            abandon(session)
            raise
    _save(session)
    return session


def load_session(url_of_journal: str) -> Session:
    """The session :func:`prepare` wrote (another process's view of it)."""
    bucket, key = split_url(url_of_journal)
    found = _load(S3Uploads(sources.scheme_of(url_of_journal) or "s3"), bucket, key)
    if found is None:
        raise CkptError("no upload journal", path=sources.shown(url_of_journal))
    return found


def upload_run(
    session: Session,
    file: FilePlan,
    *,
    first: int = 1,
    last: int | None = None,
    crcs: dict[int, int] | None = None,
    have: dict[int, PartDone] | None = None,
    progress: Progress | None = None,
    on_sent: Any = None,
) -> RunResult:
    """Write and upload parts ``first..last`` of ``file`` (any process).

    ``have``: parts already there (a rerun): one whose size and MD5 match is not sent
    again. Returns the parts sent, the CRCs computed, and the parts deferred (they
    need CRCs of pieces in other runs: call again with ``crcs`` merged from every run).
    """
    upload = session.file(file.name)
    store = session.store()
    have = have or {}

    def send(number: int, data: memoryview) -> PartDone:
        there = have.get(number)
        if there is not None and there.size == len(data) and there.etag == md5_etag(data):
            return there
        return store.upload_part(session.bucket, upload.key, upload.upload_id, number, data)

    return write_parts(
        file,
        upload.part_size,
        send,
        first=first,
        last=last,
        crcs=crcs,
        progress=progress,
        on_sent=on_sent,
    )


def finish(session: Session, layout: FolderLayout | None) -> None:
    """Check every file's parts (all there, each its planned size), complete the data
    files, then the last one (the index), then remove the objects of an earlier output
    that this one replaces (``--force``) and the journal. One process calls it."""
    store = session.store()
    listed: dict[str, list[PartDone]] = {}
    for upload in session.files:
        if upload.etag and store.list_parts(session.bucket, upload.key, upload.upload_id) is None:
            listed[upload.key] = []  # completed by an earlier run (prepare checked it)
            continue
        parts = store.list_parts(session.bucket, upload.key, upload.upload_id) or {}
        want = list(range(1, upload.parts + 1))
        if sorted(parts) != want:
            missing = sorted(set(want) - set(parts))[:5]
            raise CkptError(
                f"parts missing from the upload ({', '.join(map(str, missing))}, ...)",
                path=sources.shown(session.url(upload.key)),
            )
        for number in want:
            start, stop = part_range(upload.size, upload.part_size, number)
            if parts[number].size != stop - start:
                raise CkptError(
                    f"part {number} holds {parts[number].size} bytes, {stop - start} planned",
                    path=sources.shown(session.url(upload.key)),
                )
        listed[upload.key] = [parts[n] for n in want]
        upload.etag = multipart_etag(listed[upload.key])
    _save(session)  # the completed objects' ETags: a rerun recognises them
    last = [u for u in session.files if layout is not None and u.name == layout.last]
    first = [u for u in session.files if u not in last]

    def complete(upload: FileUpload) -> None:
        if listed[upload.key]:
            store.complete(session.bucket, upload.key, upload.upload_id, listed[upload.key])
        _forget(session.url(upload.key))

    with ThreadPoolExecutor(COMPLETE_THREADS) as pool:
        list(pool.map(complete, first))
    for upload in last:
        complete(upload)
    written = {u.key for u in session.files}
    if session.folder is not None:
        for name in session.replaced:
            key = _join(session.folder, name)
            if key not in written:
                store.delete(session.bucket, key)
                _forget(session.url(key))
    store.delete(session.bucket, session.journal_key)


def abandon(session: Session) -> None:
    """Abort every upload of the session that is not completed, and drop its journal."""
    store = session.store()
    for upload in session.files:
        if upload.upload_id:
            store.abort(session.bucket, upload.key, upload.upload_id)
    store.delete(session.bucket, session.journal_key)


def write(
    plan: Plan,
    url: str,
    *,
    layout: FolderLayout | None,
    force: bool,
    inputs: Sequence[str],
    progress: Progress | None = None,
) -> Outcome | None:
    """Write ``plan`` to ``url`` from this process: prepare, every part, finish.

    A rerun after a failure resumes (only the parts not there are uploaded): what it
    reused is returned (None when nothing was). Every error says what was left (the
    upload ids) and whether it was aborted.
    """
    identities = [sources.identity(p) for p in inputs]
    session = prepare(plan, url, layout=layout, force=force, identities=identities)
    store = session.store()
    outcome = Outcome(sum(upload.parts for upload in session.files), kind="part")
    try:
        for file in plan.files:
            upload = session.file(file.name)
            if upload.etag and store.head(session.bucket, upload.key) == (upload.size, upload.etag):
                outcome.reused += upload.parts  # completed by the earlier run
                outcome.reused_bytes += upload.size
                continue
            have = store.list_parts(session.bucket, upload.key, upload.upload_id) or {}
            kept = [n for n in have if _fits(have[n], upload, n)]
            outcome.reused += len(kept)
            outcome.reused_bytes += sum(have[n].size for n in kept)
            _upload_file(session, file, have, progress)
        finish(session, layout)
    except (KeyboardInterrupt, SystemExit):
        _save_quietly(session)  # the uploads stay: a rerun resumes them
        raise
    except UploadFailed as exc:
        _save_quietly(session)
        raise UploadFailed(
            f"{exc.message}; nothing is visible under the output; left for a rerun of the "
            f"same command to resume: {session.upload_ids()}",
            path=exc.path,
        ) from None
    except BaseException as exc:
        cleaned = "aborted"
        try:
            abandon(session)
        except CkptError:
            cleaned = "left (aborting failed too: abort them, or let a lifecycle rule)"
        if isinstance(exc, CkptError):
            raise CkptError(
                f"{exc.message}; nothing was written under the output; {session.upload_ids()} "
                f"{cleaned}",
                path=exc.path,
                hint=exc.hint,
            ) from None
        raise
    return outcome if outcome.reused else None


def _upload_file(
    session: Session, file: FilePlan, have: dict[int, PartDone], progress: Progress | None
) -> None:
    """Upload the parts of ``file`` that are not there (all of them on a first run).

    The CRCs computed go into the journal every ``JOURNAL_EVERY_S`` seconds. Parts whose
    CRC fields need tensors of parts not written again are written once the CRCs are
    known (the journal's, or this run's).
    """
    upload = session.file(file.name)
    crc_pieces = {p.offset for p in file.pieces if p.crc}
    saved = session.crcs.setdefault(file.name, {})
    known = _known_crcs(session, file)
    last_save = [time.monotonic()]

    def keep(crcs: Any, last: bool) -> None:
        due = time.monotonic() - last_save[0] >= JOURNAL_EVERY_S
        if due or last:  # (copied this seldom: a file may hold 10**5 tensors)
            saved.update({str(o): c for o, c in crcs.items()})
        if due:
            _save(session)
            last_save[0] = time.monotonic()

    crcs = dict(known)
    deferred: list[int] = []
    for first, last in _runs(file, upload, have, known):
        result = upload_run(
            session,
            file,
            first=first,
            last=last,
            crcs=known,
            have=have,
            progress=progress,
            on_sent=keep if crc_pieces else None,
        )
        crcs.update(result.crcs)
        deferred += result.deferred
    for number in deferred:
        upload_run(session, file, first=number, last=number, crcs=crcs, have=have)


def _known_crcs(session: Session, file: FilePlan) -> dict[int, int]:
    """The CRCs the journal holds of ``file``'s pieces (of pieces that keep one only)."""
    crc_pieces = {p.offset for p in file.pieces if p.crc}
    saved = session.crcs.get(file.name)
    found: dict[int, int] = {}
    for offset, crc in (saved if isinstance(saved, dict) else {}).items():
        if str(offset).isdigit() and int(offset) in crc_pieces and isinstance(crc, int):
            found[int(offset)] = crc & 0xFFFFFFFF
    return found


def _runs(
    file: FilePlan, upload: FileUpload, have: dict[int, PartDone], known: dict[int, int]
) -> list[tuple[int, int]]:
    """The runs of parts to write: the parts not there, and, where a missing part holds
    a field built from CRCs not ``known`` (a zip's), the part where each of those
    tensors starts (it is read again; that part, already there, is checked by its MD5
    and not sent)."""
    size = upload.part_size
    want = {n for n in range(1, upload.parts + 1) if not _fits(have.get(n), upload, n)}
    crc_pieces = {p.offset for p in file.pieces if p.crc}
    for piece in file.pieces:
        if piece.build is None:
            continue
        spans = range(piece.offset // size + 1, (max(piece.end, piece.offset + 1) - 1) // size + 2)
        if want.intersection(spans):
            want.update(o // size + 1 for o in piece.needs if o in crc_pieces and o not in known)
    runs: list[tuple[int, int]] = []
    for number in sorted(want):
        if runs and runs[-1][1] == number - 1:
            runs[-1] = (runs[-1][0], number)
        else:
            runs.append((number, number))
    return runs


def _fits(part: PartDone | None, upload: FileUpload, number: int) -> bool:
    """A part already there is the planned size."""
    start, stop = part_range(upload.size, upload.part_size, number)
    return part is not None and part.size == stop - start


def _check_existing(
    store: S3Uploads,
    bucket: str,
    keys: list[str],
    folder: str | None,
    layout: FolderLayout | None,
    force: bool,
    done: set[str],
    scheme: str,
) -> list[str]:
    """Refuse what may not be replaced; the names of an earlier folder output replaced."""
    if folder is None or layout is None:
        (key,) = keys
        if key in done or store.head(bucket, key) is None:
            return []
        url = f"{scheme}://{bucket}/{key}"
        if not force:
            raise OutputExistsError(
                "output exists", path=sources.shown(url), hint="pass --force to overwrite it"
            )
        if not _is_checkpoint_object(url):
            raise CkptError(
                "the object there is not a checkpoint; --force replaces only what ckpttool writes",
                path=sources.shown(url),
                hint="move it away or choose another -o",
            )
        return []
    owned = [n for n in store.list_names(bucket, folder) if layout.owns(n)]
    theirs = [n for n in owned if _join(folder, n) not in done]
    if theirs and not force:
        shown = ", ".join(theirs[:3]) + (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
        raise OutputExistsError(
            f"output exists: the folder holds {layout.kind} ({shown})",
            path=sources.shown(f"{scheme}://{bucket}/{folder}"),
            hint="pass --force to replace them; other objects in it stay",
        )
    return owned


def _is_checkpoint_object(url: str) -> bool:
    """An object ckpttool writes as an output: safetensors, or a torch.save zip."""
    from ..formats import is_output_file

    try:
        return is_output_file(url)
    finally:
        _forget(url)


def _forget(url: str) -> None:
    """Drop what this process's reader knows of ``url`` (its size, cached blocks): it
    was just written."""
    source: Any = sources.source_for(url)
    forget = getattr(source, "forget", None)
    if forget is not None:
        forget(url)


def _join(folder: str, name: str) -> str:
    """A key inside a folder output's prefix (the bucket's root when it is empty)."""
    return f"{folder}/{name}" if folder else name


def _hidden(key: str) -> str:
    folder, _, name = key.rpartition("/")
    return f"{folder}/.{name}{JOURNAL_NAME}" if folder else f".{name}{JOURNAL_NAME}"


def _load(store: S3Uploads, bucket: str, key: str) -> Session | None:
    raw = store.get(bucket, key)
    if raw is None:
        return None
    try:
        return Session.from_json(raw)
    except (ValueError, TypeError, KeyError):
        return None  # not ours, or damaged: a fresh start (the uploads expire by lifecycle)


def _save_quietly(session: Session) -> None:
    """Save the journal (its CRCs) where a failure leaves the uploads for a rerun; a
    failure to do so only costs the rerun a read."""
    try:
        _save(session)
    except CkptError:
        pass


def _save(session: Session) -> None:
    session.store().put(session.bucket, session.journal_key, session.to_json().encode())


# ---------------------------------------------------------------- several processes


def assign_runs(session: Session, world: int) -> list[list[tuple[str, int, int]]]:
    """Every file's parts split among ``world`` processes by bytes, in plan order:
    for each rank, its runs ``(file name, first, last)`` (contiguous, whole parts)."""
    parts = [(f.name, n, f.part_size) for f in session.files for n in range(1, f.parts + 1)]
    total = sum(f.size for f in session.files) or 1
    runs: list[list[tuple[str, int, int]]] = [[] for _ in range(world)]
    done = 0
    for name, number, part_size in parts:
        upload = session.file(name)
        start, stop = part_range(upload.size, part_size, number)
        rank = min(world - 1, done * world // total)
        done += stop - start
        mine = runs[rank]
        if mine and mine[-1][0] == name and mine[-1][2] == number - 1:
            mine[-1] = (name, mine[-1][1], number)
        else:
            mine.append((name, number, number))
    return runs


def write_ranks(
    plan: Plan,
    url: str,
    *,
    layout: FolderLayout | None,
    force: bool,
    inputs: Sequence[str],
    rank: int,
    world: int,
    broadcast: Any,
    all_gather: Any,
    progress: Progress | None = None,
) -> None:
    """Write ``plan`` to ``url`` from ``world`` processes, each calling this with the
    same plan (made from the same inputs) and its ``rank``.

    Rank 0 prepares (checks, journal, uploads); every rank uploads its share of the parts
    (:func:`assign_runs`); the parts whose CRC fields need other ranks' tensors are
    uploaded again once every rank's CRCs are gathered; rank 0 completes (index last).
    A rerun resumes as :func:`write` does. Every rank raises the same error.

    Args:
        broadcast: ``broadcast(obj)``: rank 0's ``obj`` on every rank (e.g. through
            ``torch.distributed.broadcast_object_list``).
        all_gather: ``all_gather(obj)``: every rank's ``obj``, in rank order
            (``torch.distributed.all_gather_object``).
    """
    status: Any = None
    if rank == 0:
        status = _attempt(
            lambda: prepare(
                plan,
                url,
                layout=layout,
                force=force,
                identities=[sources.identity(p) for p in inputs],
            ).to_json()
        )
    status = broadcast(status)
    _raise_first([status], None, rank)
    session = Session.from_json(status[1])
    files = {f.name: f for f in plan.files}
    known = {f.name: _known_crcs(session, f) for f in plan.files}

    def upload_mine() -> tuple[dict[str, dict[int, int]], list[tuple[str, int]]]:
        crcs: dict[str, dict[int, int]] = {}
        deferred: list[tuple[str, int]] = []
        store = session.store()
        have_of: dict[str, dict[int, PartDone]] = {}
        for name, first, last in assign_runs(session, world)[rank]:
            upload = session.file(name)
            if name not in have_of:
                listed = store.list_parts(session.bucket, upload.key, upload.upload_id)
                have_of[name] = listed or {}
            have = have_of[name]
            runs = _runs(files[name], upload, have, known[name])
            for a, b in [r for r in runs if r[1] >= first and r[0] <= last]:
                a, b = max(a, first), min(b, last)
                result = upload_run(
                    session,
                    files[name],
                    first=a,
                    last=b,
                    crcs=known[name],
                    have=have,
                    progress=progress,
                )
                crcs.setdefault(name, {}).update(result.crcs)
                deferred += [(name, n) for n in result.deferred]
        return crcs, deferred

    gathered = all_gather(_attempt(upload_mine))
    _raise_first(gathered, session, rank)
    every = {name: dict(crcs) for name, crcs in known.items()}
    for _, (crcs, _deferred) in gathered:
        for name, found in crcs.items():
            every.setdefault(name, {}).update(found)

    def upload_deferred() -> None:
        store = session.store()
        for name, number in gathered[rank][1][1]:
            upload = session.file(name)
            have = store.list_parts(session.bucket, upload.key, upload.upload_id) or {}
            upload_run(
                session, files[name], first=number, last=number, crcs=every.get(name), have=have
            )

    gathered = all_gather(_attempt(upload_deferred))
    _raise_first(gathered, session, rank)
    status = _attempt(lambda: finish(session, layout)) if rank == 0 else None
    status = broadcast(status)
    _raise_first([status], session, rank)


def _attempt(call: Any) -> tuple[str, Any]:
    """``("ok", result)``, or what failed: ``("keep", line)`` (the uploads may be resumed),
    ``("abort", line)`` (they may not)."""
    try:
        return "ok", call()
    except UploadFailed as exc:
        return "keep", exc.one_line()
    except CkptError as exc:
        return "abort", exc.one_line()
    except Exception as exc:  # a bug: one line still, and the uploads go
        return "abort", f"unexpected {type(exc).__name__}: {str(exc)[:200]}"


def _raise_first(statuses: Sequence[Any], session: Session | None, rank: int) -> None:
    """Raise, on every rank alike, the first failure among ``statuses`` (rank 0 aborts
    the uploads where a rerun cannot mend it)."""
    failed = [(r, s) for r, s in enumerate(statuses) if s[0] != "ok"]
    if not failed:
        return
    where, (_, line) = failed[0]
    who = f"rank {where}: " if len(statuses) > 1 else ""
    if session is None:
        raise CkptError(f"{who}{line}")
    if all(s[0] == "keep" for _, s in failed):
        raise UploadFailed(
            f"{who}{line}; nothing is visible under the output; left for a rerun of the same "
            f"command to resume: {session.upload_ids()}"
        )
    if rank == 0:
        abandon(session)
    raise CkptError(
        f"{who}{line}; nothing was written under the output; {session.upload_ids()} aborted"
    )
