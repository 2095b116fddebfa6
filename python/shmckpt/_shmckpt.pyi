"""Type stub of the compiled extension ``shmckpt._shmckpt`` (bytes-level engine calls).

Tensors are passed as ``(name, dtype, shape, memory, nbytes, device)``: ``memory`` a DLPack
capsule of the tensor's contiguous bytes (``torch.utils.dlpack.to_dlpack(t)``, a numpy
array's ``__dlpack__()``; ``None`` when ``nbytes`` is 0), ``device`` -1 for host memory,
else the CUDA ordinal. No call takes an address: the extension consumes each capsule and
keeps its tensor's memory allocated for as long as it uses it. The caller keeps the memory
unmodified (for non-blocking saves, until staged) as documented on each method; use
``shmckpt.Checkpointer``, which does.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, TypedDict, Union, final

from typing_extensions import TypeAlias

__all__ = [
    "Bucket",
    "Buffer",
    "Engine",
    "HeldImage",
    "HeldPiece",
    "PreparedArena",
    "PreparedTensors",
    "ReplicaImage",
    "ReplicaSource",
    "SaveHandle",
    "__version__",
    "assemble_ranks",
    "crc32c_of",
    "dtypes",
    "export_hf",
    "export_names",
    "find_parts",
    "group_adopt_manifest",
    "group_apply_retention",
    "group_commit",
    "group_own_part",
    "group_set_aside",
    "link_step",
    "linked_step",
    "linked_steps",
    "pending_steps",
    "publish_dir",
    "publish_into",
    "rank_file_metadata",
    "read_rank_file",
    "read_rank_ranges",
    "release_device_ring",
    "replica_divergence",
    "replica_latest",
    "replica_list",
    "replica_load",
    "replica_memory_entry",
    "replica_memory_source",
    "replica_name",
    "replica_plan",
    "replica_prepare",
    "replica_read_committed",
    "replica_receive",
    "replica_receive_memory",
    "replica_receive_pending",
    "replica_receive_restore",
    "replica_remove",
    "replica_remove_older",
    "replica_restore_file",
    "replica_serve",
    "replica_serve_memory",
    "replica_source",
    "replica_store",
    "replica_tag",
    "reserve_name",
    "resolve_name",
    "unlink_name",
]

# (name, dtype, shape, DLPack capsule or None, nbytes, device): a type of this stub, not a
# runtime name.
TensorTuple: TypeAlias = Tuple[str, str, Sequence[int], Any, int, int]
__version__: str

def dtypes() -> List[str]: ...
def replica_divergence(
    ranks: Sequence[Sequence[Tuple[str, str, Sequence[int], int]]],
) -> List[Tuple[str, List[int], List[int], Optional[int]]]: ...
def crc32c_of(data: Any, crc: int = 0) -> int:
    """CRC-32C of the host memory of DLPack capsule ``data`` (``None``: no bytes),
    continuing from ``crc``."""
    ...

@final
class Buffer:
    """Bytes of one loaded tensor, owned by the engine; numpy views them without a copy."""

    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def __array_interface__(self) -> Dict[str, object]: ...
    def __len__(self) -> int: ...

@final
class ReplicaImage:
    """An image received from a peer straight into its final memory: a replica arena in
    ``/dev/shm`` (``replica_receive``) or private memory restoring a lost rank
    (``replica_receive_restore``). numpy views it without a copy (writable while open);
    ``seal()`` makes it read-only, checks it against the committed manifest and publishes
    it (the replica under its name, or the rank's file written back; the memory of a
    restore is then writable again). A failed check removes it; an unsealed image is never
    listed or served."""

    @property
    def nbytes(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def __array_interface__(self) -> Dict[str, object]: ...
    def __len__(self) -> int: ...
    @property
    def restore(self) -> bool: ...
    def tensors(self) -> List[Tuple[str, str, List[int], int, int]]: ...
    def received(self, end: int) -> None: ...
    @property
    def checked_tensors(self) -> int: ...
    def seal(self, keep_older: bool = False) -> str: ...
    def commit_pending(self) -> Optional[str]: ...
    def withdraw_pending(self) -> None: ...

@final
class ReplicaSource:
    """A rank's committed file, read into memory piece by piece as it is sent
    (``read_range(start, end)``); numpy views the memory read-only (the pieces read
    hold the file's bytes)."""

    @property
    def nbytes(self) -> int: ...
    @property
    def __array_interface__(self) -> Dict[str, object]: ...
    def __len__(self) -> int: ...
    def read_range(self, start: int, end: int) -> None: ...

@final
class HeldPiece:
    """Consecutive staging chunks of a held image, read-only, without a copy; the chunks
    return to the arena when this object is dropped."""

    @property
    def nbytes(self) -> int: ...
    @property
    def __array_interface__(self) -> Dict[str, object]: ...
    def __len__(self) -> int: ...

@final
class HeldImage:
    """A committed save's image held in its staging chunks for replication
    (``SaveHandle.take_held_image()``): ``piece(start, end)`` gives ``("staging",
    HeldPiece)``, ``("copied", Buffer)`` or ``("file", None)`` (given back under staging
    pressure: read it from the file); ``close()`` gives back what is not taken."""

    @property
    def nbytes(self) -> int: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def held_chunks(self) -> int: ...
    @property
    def spilled_chunks(self) -> int: ...
    def piece(self, start: int, end: int) -> Tuple[str, Optional[Union[HeldPiece, Buffer]]]: ...
    def close(self) -> None: ...

@final
class Bucket:
    """A bucket prefix (``s3://bucket/prefix``) of the object-storage tier on its own
    (used by ``shmckpt.dcp`` for ``s3://`` checkpoints)."""

    def __new__(cls, url: str, part_size: Optional[int] = None, concurrency: Optional[int] = None) -> "Bucket": ...
    @property
    def url(self) -> str: ...
    def list(self) -> List[int]: ...
    def manifest(self, step: int) -> str: ...
    def load(self, step: int, rank: int) -> Tuple[int, str, Dict[str, str], List[Tuple[str, str, List[int], Buffer]]]: ...
    def put_extra(self, step: int, name: str, data: bytes) -> bool: ...
    def get_extra(self, step: int, name: str, cap: int) -> Optional[bytes]: ...

@final
class SaveHandle:
    @property
    def step(self) -> int: ...
    def is_staged(self) -> bool: ...
    def is_done(self) -> bool: ...
    def hold_streams(self, streams: Sequence[Tuple[int, Any]]) -> None: ...
    def request_snapshot(self) -> None: ...
    def snapshot_bytes(self) -> int: ...
    def wait_staged(self) -> Optional[Dict[str, object]]: ...
    def wait(self) -> Dict[str, object]: ...
    def wait_remote(self) -> Dict[str, object]: ...
    def is_remote_done(self) -> bool: ...
    def take_held_image(self) -> Optional[HeldImage]: ...
    def checksums(self) -> Optional[List[Tuple[str, str, List[int], int]]]: ...
    def confirm_commit(self, reason: Optional[str] = None) -> None: ...

class EngineSettings(TypedDict, total=False):
    """The settings of ``Engine(root, config)``, one dict converted once in Rust
    (``python/src/config.rs``); a missing key or ``None`` takes the default, another key
    is a ``TypeError``. ``shmckpt.config.engine_settings`` builds it from the groups."""

    rank: int
    world_size: int
    staging_capacity: Optional[int]
    chunk_size: Optional[int]
    writer_threads: Optional[int]
    queue_depth: Optional[int]
    copy_threads: Optional[int]
    copy_ahead: Optional[int]
    stream_latches: Optional[bool]
    blocking_sync: Optional[bool]
    direct_io: Optional[bool]
    keep_last: Optional[int]
    shm_name: Optional[str]
    max_inflight_saves: Optional[int]
    recover_on_open: Optional[bool]
    keep_in_memory: Optional[bool]
    create_root: Optional[bool]
    remote: Optional[str]
    remote_keep_last: Optional[int]
    remote_max_pending: Optional[int]
    remote_only: Optional[bool]
    session: Optional[str]
    remote_part_size: Optional[int]
    remote_concurrency: Optional[int]
    remote_request_timeout: Optional[float]
    remote_complete_timeout: Optional[float]
    replica_hold: Optional[bool]
    disk_every: Union[int, str, None]
    disk_interval_s: Optional[float]
    remote_every: Optional[int]
    memory_steps: Optional[int]

@final
class PreparedTensors:
    """A save's tensors checked and taken from their capsules ahead of it
    (``Engine.prepare``), for one later ``Engine.save``, which takes them."""

    def __len__(self) -> int: ...
    @property
    def taken(self) -> bool: ...
    def release(self) -> None: ...

@final
class Engine:
    def __new__(cls, root: str, config: Optional[Mapping[str, Any]] = None) -> "Engine": ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def copy_ahead(self) -> int: ...
    @property
    def stream_latches(self) -> bool: ...
    @property
    def blocking_sync(self) -> bool: ...
    def prepare(self, tensors: Sequence[TensorTuple]) -> PreparedTensors: ...
    def save(
        self,
        step: int,
        tensors: Union[Sequence[TensorTuple], PreparedTensors],
        metadata: Dict[str, str],
        after: Sequence[Tuple[int, str, Any]],
        blocking: bool,
        hold: bool = False,
        snapshot: bool = False,
        part_only: bool = False,
        confirm: bool = False,
        provisional: bool = False,
    ) -> SaveHandle: ...
    def load(
        self, step: Optional[int] = None, bucket: bool = True
    ) -> Tuple[int, str, Dict[str, str], List[Tuple[str, str, List[int], Buffer]]]: ...
    def load_into(self, step: Optional[int], dest: Sequence[Tuple[str, Any]]) -> int: ...
    def load_into_device(
        self, step: Optional[int], dest: Sequence[Tuple[str, Any, int]], bucket: bool = True
    ) -> int: ...
    def last_load_source(self) -> Optional[Tuple[str, Optional[str]]]: ...
    def recovered(self) -> List[int]: ...
    def open_timings(self) -> List[Tuple[str, float]]: ...
    def unrecovered(self) -> List[str]: ...
    def list(self) -> List[Tuple[int, str]]: ...
    def list_remote(self) -> List[int]: ...
    def load_remote(
        self, step: Optional[int] = None
    ) -> Tuple[int, str, Dict[str, str], List[Tuple[str, str, List[int], Buffer]]]: ...
    def load_into_device_remote(
        self, step: Optional[int], dest: Sequence[Tuple[str, Any, int]]
    ) -> Tuple[int, int, int, int, float]: ...
    def last_remote_device_load(self) -> Optional[Tuple[int, int, int, int, float]]: ...
    def remote_file_metadata(self, step: int) -> Dict[str, str]: ...
    def remote_manifest(self, step: int) -> str: ...
    def latest(self) -> Optional[int]: ...
    def resolve(self, step: Optional[int] = None, source: Optional[str] = None) -> Tuple[int, str]: ...
    def latest_in(self, source: Optional[str] = None) -> Optional[int]: ...
    def list_in(self, source: Optional[str] = None) -> List[Tuple[int, List[str]]]: ...
    def manifest(self, step: Optional[int] = None) -> str: ...
    def file_metadata(self, step: Optional[int] = None) -> Dict[str, str]: ...
    def prepare_cuda(self, devices: Sequence[int]) -> Optional[float]: ...
    def prepare_cuda_background(self, devices: Sequence[int]) -> None: ...
    def staging_ready(self) -> bool: ...
    def wait_staging_ready(self) -> None: ...
    def flush(self) -> None: ...
    def remove(self, step: int) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def describe(self) -> Tuple[str, int, str, str]: ...

def link_step(root: str, name: str, step: int) -> Optional[int]: ...
def linked_step(root: str, name: str) -> Optional[int]: ...
def linked_steps(root: str) -> List[int]: ...
def unlink_name(root: str, name: str) -> Optional[int]: ...
def reserve_name(root: str, name: str, step: int) -> bool: ...
def resolve_name(root: str, name: str) -> Optional[Tuple[int, Optional[str]]]: ...
def publish_into(dir: str, files: Sequence[Tuple[str, bytes]], target: str) -> None:
    """Write ``files`` durably into the assembled directory ``dir``, then move its rank
    files, ``manifest.json`` and, last, ``files`` into the existing directory ``target``."""
    ...

def rank_file_metadata(dir: str, rank: int, *, step: Optional[int] = None) -> Dict[str, str]:
    """The ``__metadata__`` of ``rank``'s file of the committed step directory ``dir``,
    read after its header is checked against the manifest (tensors, header CRC-32C).
    ``step``: the manifest must be of that step (``CorruptError`` naming both if not)."""
    ...

def read_rank_file(
    dir: str,
    rank: int,
    *,
    direct_io: bool = True,
    queue_depth: int = 4,
    device: Optional[Sequence[Tuple[str, Any, int]]] = None,
    host: Optional[Sequence[Tuple[str, Any]]] = None,
    step: Optional[int] = None,
) -> Tuple[str, Dict[str, str], List[Tuple[str, str, List[int], int, int, int, Optional[Buffer]]]]:
    """Read ``rank``'s file of the committed step directory ``dir`` once (used by
    ``shmckpt.dcp.ShmckptReader``): header checked against the manifest, every CRC-32C
    verified. ``device`` lists ``(tensor name, capsule, device)`` and ``host`` ``(tensor
    name, capsule)``, each a DLPack capsule of a writable, contiguous CUDA tensor of that
    device or host tensor: those tensors are copied into that memory (exactly their size,
    through registered read buffers) as the file is read; the caller leaves the memory
    unused meanwhile. Returns ``(file name, metadata, [(name,
    dtype, shape, crc32c, file offset, nbytes, Buffer or None)])`` in file order, ``None``
    for a tensor copied to a destination. ``step``: the step the caller knows ``dir``
    holds; a manifest of another step is ``CorruptError`` naming both."""
    ...

def read_rank_ranges(
    dir: str,
    rank: int,
    names: Sequence[str],
    *,
    direct_io: bool = True,
    queue_depth: int = 4,
    gap: Optional[int] = None,
    device: Optional[Sequence[Tuple[str, Any, int]]] = None,
    host: Optional[Sequence[Tuple[str, Any, int]]] = None,
) -> Tuple[
    str, Dict[str, str], List[Tuple[str, str, List[int], int, int, int, Optional[Buffer]]], Dict[str, int]
]:
    """Read only the requested tensors of ``rank``'s file of the committed checkpoint
    directory ``dir`` (used by ``shmckpt.dcp.ShmckptReader``): ``names`` come back in
    buffers of their own; ``host`` lists ``(tensor name, capsule, begin)``: bytes ``[begin,
    begin + nbytes)`` of the tensor are copied to the writable host memory of the DLPack
    capsule (``nbytes`` its length); ``device`` lists ``(tensor name, capsule, device)``:
    the whole tensor is copied to that CUDA tensor's memory (through registered read
    buffers). The caller leaves the memory unused meanwhile; destinations must not overlap. Each requested tensor is
    read whole, once, its CRC-32C verified against the manifest (a sub-range cannot be
    verified alone); tensors at most ``gap`` bytes apart (``None``: 128 KiB) are read
    together. A tensor the file does not hold is a ``DestinationError``. Returns ``(file
    name, metadata, [(name, dtype, shape, crc32c, file offset, nbytes, Buffer or None)],
    stats)``, one tuple per requested tensor in file order (``None`` unless it was in
    ``names``); ``stats``: ``bytes`` (read from the file, gaps and O_DIRECT page padding
    included), ``reads``, ``tensors``, ``direct_io`` (1 when O_DIRECT was used)."""
    ...

def assemble_ranks(
    sources: Sequence[str],
    out: str,
    step: int,
    target: str,
    metadata: Dict[str, str],
) -> Tuple[int, List[Tuple[str, int, List[Tuple[str, int, int, int]]]]]:
    """Commit the ranks of one DCP save (``shmckpt::commit::assemble_ranks``): move rank
    K's durable file from ``sources[K]`` (the partial directory of its part-only save)
    into the new directory ``out`` and write its
    ``manifest.json`` (of ``step``, or N when ``target`` is named ``step-N``). Returns
    ``(step, [(file, data_start, [(tensor, begin, end, crc32c)])])`` in rank order."""
    ...

def find_parts(dir: str, step: int) -> List[str]:
    """The partial directories of ``step`` that part-only saves (``Engine.save(...,
    part_only=True)``) left in the engine roots directly under ``dir``, sorted; links are
    not followed."""
    ...

def publish_dir(
    dir: str, files: Sequence[Tuple[str, bytes]], target: str, replace: Optional[str] = None
) -> None:
    """Write ``files`` (``(name, bytes)``) durably into the assembled directory ``dir`` and
    publish it as ``target`` (which must not exist, or be empty) with one rename; with
    ``replace`` (a marker file name), a directory holding that regular file is replaced
    atomically (``renameat2(RENAME_EXCHANGE)``, then the old tree is removed)."""
    ...

def release_device_ring() -> None:
    """Free the registered read buffers of device reads (made again by the next one)."""
    ...

# Peer replicas (shmckpt.replicas; the protocol is the crate's shmckpt::replica).
def replica_plan(nodes: Sequence[str], replicas: int) -> List[List[int]]:
    """For each rank, the ranks on other machines that hold its replicas (``nodes[r]``:
    rank r's machine). ``ConfigError`` when ``replicas`` is not below the machine count."""
    ...

def replica_latest(
    views: Sequence[
        Tuple[
            Sequence[int],
            Sequence[int],
            Sequence[Tuple[int, int]],
            Sequence[int],
            Sequence[int],
            Sequence[Tuple[int, int]],
            Sequence[int],
        ]
    ],
    plan: Sequence[Sequence[int]],
) -> Tuple[List[Tuple[int, str, List[Tuple[int, int]], List[int]]], Optional[int]]:
    """The step every rank loads for "latest" (``shmckpt::replica::agree``). ``views[q]``:
    rank ``q``'s ``(known, own, held, bucket, parts, pending, committed)``. Returns the
    candidates, newest first up to the first every rank can load, as ``(step, kind,
    servers, short)`` with kind ``"load"``, ``"complete"`` (``servers``: the ``(rank,
    partner)`` pairs of the commit to complete) or ``"short"`` (``short``: the ranks that
    cannot load it), and the newest step any rank knows of."""
    ...

def replica_name(root: str, rank: int, step: int) -> str:
    """The ``/dev/shm`` name of the replica of ``rank``'s image of ``step`` of ``root``."""
    ...

def replica_tag(root: str) -> str:
    """The tag replica names carry for ``root`` (FNV-1a 64 of the canonical path)."""
    ...

def replica_read_committed(root: str, step: int, rank: int) -> Buffer:
    """``rank``'s committed file of ``step``, read and checked against the manifest."""
    ...

def replica_store(root: str, step: int, rank: int, data: bytes) -> str:
    """Check ``data`` as ``rank``'s image of ``step`` and store it as a replica; its name."""
    ...

@final
class PreparedArena:
    """A replica arena made before its step is committed (``replica_prepare``)."""

    @property
    def nbytes(self) -> int: ...

def replica_prepare(root: str, step: int, rank: int, len: int) -> PreparedArena:
    """``len`` bytes of ``/dev/shm`` for ``rank``'s image of ``step``, allocated before the
    step is committed; handed to ``replica_receive``, removed if dropped unused."""
    ...

def replica_receive(root: str, step: int, rank: int, prepared: Optional[PreparedArena] = None) -> ReplicaImage:
    """A new replica arena in ``/dev/shm`` for ``rank``'s image of the committed ``step``
    (``prepared``, resized to the manifest's size, when given)."""
    ...

def replica_remove_older(root: str, rank: int, step: int, keep: Optional[int] = None) -> None:
    """Remove this user's replicas of ``rank``'s images of ``root`` other than ``step``'s
    (and ``keep``'s, when given)."""
    ...

def replica_receive_memory(
    root: str, step: int, rank: int, entry: str, prepared: Optional[PreparedArena] = None
) -> ReplicaImage:
    """A new replica arena in ``/dev/shm`` for ``rank``'s image of the memory-only ``step``,
    checked by ``seal()`` against ``entry`` (the JSON manifest entry its sender computed,
    ``replica_memory_source``) instead of a committed manifest."""
    ...

def replica_receive_restore(root: str, step: int, rank: int) -> ReplicaImage:
    """Private memory receiving ``rank``'s image of the committed ``step`` to restore it."""
    ...

def replica_source(root: str, step: int, rank: int) -> ReplicaSource:
    """``rank``'s committed file of ``step``, opened and checked (no link, regular, the
    manifest's size, its header) to be read as it is sent."""
    ...

def replica_memory_source(engine: Engine, step: int) -> Tuple[ReplicaSource, str]:
    """The held memory-only ``step`` of ``engine`` as a replica source: its image copied out
    of staging (under the memory tier's lock), and this rank's manifest entry with the
    checksums computed from that copy, as JSON. ``NotFoundError`` when it is not held."""
    ...

def replica_serve(root: str, step: int, rank: int) -> ReplicaImage:
    """This user's replica of ``rank``'s image of ``step``, mapped read-only and checked in
    full in place (sealed: sent without a copy)."""
    ...

def replica_serve_memory(root: str, step: int, rank: int) -> ReplicaImage:
    """This user's replica of ``rank``'s image of the memory-only ``step`` (not committed),
    mapped read-only and checked in full in place against the entry kept beside it."""
    ...

def replica_memory_entry(root: str, step: int, rank: int) -> str:
    """The entry kept beside this user's replica of ``rank``'s image of the memory-only
    ``step`` (JSON), read back and checked."""
    ...

def replica_receive_pending(root: str, step: int, rank: int, world_size: int, entry: str) -> ReplicaImage:
    """Private memory receiving ``rank``'s image of the uncommitted ``step`` from a
    partner's replica of the memory-only step, checked against ``entry`` (the partner's):
    ``seal()`` writes the rank's file into the step's partial directory,
    ``commit_pending()`` its part, committing the step once every part is there."""
    ...

def replica_load(root: str, step: int, rank: int) -> Buffer:
    """This user's replica of ``rank``'s image of ``step``, checked in full."""
    ...

def replica_restore_file(root: str, step: int, rank: int, data: bytes) -> str:
    """Check ``data`` as ``rank``'s image of ``step``; write it back as that rank's file."""
    ...

def replica_list() -> List[Tuple[str, str, int, int, int, int]]:
    """Every replica in ``/dev/shm``: ``(name, root tag, rank, step, bytes, owner uid)``."""
    ...

def replica_remove(name: str) -> None:
    """Remove this user's replica ``name`` (never through a link)."""
    ...

def group_own_part(root: str, step: int, rank: int) -> bytes:
    """This rank's manifest part of ``step`` (JSON), for a commit through the group."""
    ...

def pending_steps(root: str, rank: int) -> List[int]:
    """The steps not committed whose partial directory holds this rank's durable part and
    its file (a regular file of this user, of the part's size)."""
    ...

def group_commit(root: str, step: int, rank: int, parts: List[bytes], metadata: Dict[str, str]) -> str:
    """Commit ``step`` in this machine's ``root`` from every rank's part; the directory."""
    ...

def group_adopt_manifest(root: str, step: int, manifest: bytes) -> str:
    """Publish a peer's committed manifest of ``step`` in this machine's ``root``."""
    ...

def group_apply_retention(root: str, keep: int) -> List[int]:
    """Keep the newest ``keep`` committed steps of this machine's ``root``; the deleted steps."""
    ...

def group_set_aside(root: str, step: int) -> Optional[str]:
    """Set the committed ``step`` of ``root`` aside (renamed ``step-N.aside-<unix ms>``: not
    listed or loaded, nothing deleted); the new directory, or None."""
    ...

def export_names(src: str, include_optimizer: bool) -> List[Tuple[str, str, List[int]]]:
    """The tensors ``export_hf`` takes from ``src`` by default, ``[(name, dtype, shape)]``,
    named after the default selection and before renaming."""
    ...

def export_hf(
    src: str,
    out: str,
    max_shard_size: str,
    names: Optional[Sequence[Tuple[str, str]]],
    dtype: Optional[str],
    include_optimizer: bool,
    overwrite: bool,
) -> Dict[str, Any]:
    """Export ``src`` to the Hugging Face layout in ``out`` (``shmckpt::export``); returns
    the report (source, step, files, tensors, bytes, bytes_read, seconds)."""
    ...
