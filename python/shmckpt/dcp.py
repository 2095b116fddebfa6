"""PyTorch Distributed Checkpoint (DCP) storage through shmckpt.

    import torch.distributed.checkpoint as dcp
    from shmckpt.dcp import ShmckptWriter, ShmckptReader

    resp = dcp.async_save(state_dict, storage_writer=ShmckptWriter("/ckpt/step-100"))
    ...
    dcp.load(state_dict, storage_reader=ShmckptReader("/ckpt/step-100"))

DCP keeps doing what it does (planning, de-duplication of replicated tensors, DTensor /
FSDP2 / ShardedTensor shards, ``Stateful`` objects, resharding on load); shmckpt replaces
the staging and the storage:

* ``ShmckptWriter`` is a ``StorageWriter`` and DCP's ``AsyncStager``, so ``async_save``
  uses it as its stager. ``stage()`` hands every tensor (the local shard of a DTensor) to
  the engine of this rank, which copies it into its shared-memory arena (device tensors
  with ``cuMemcpyDtoHAsync`` on the engine's own stream, ordered after the caller's
  current stream; no device memory is allocated) and returns once everything is staged.
  The engine's io_uring writers write the file while DCP plans in its upload thread;
  ``write_data`` waits for it to be durable. Non-tensor values are serialized at the call
  (``torch.save``, as DCP's planner does) and stored as ``U8`` tensors.
* Layout: a checkpoint directory ``P`` is a committed shmckpt step directory plus DCP's
  ``.metadata``::

      P/rank-00000-of-00004.safetensors   one safetensors file per rank (CRC-32C in the manifest)
      P/manifest.json                     shmckpt's manifest (per tensor: offsets, CRC-32C)
      P/.metadata                         DCP's metadata; storage_data = ShmckptStorageInfo
                                          (file, offset, length, tensor name, CRC-32C)

* Commit: each rank's engine writes its file and manifest part into its own root in the
  spool ``dirname(P)/.shmckpt-dcp`` (``step-N.partial``; ``N`` is a private number the
  ranks agree on). DCP's coordinator (``finish``) then commits through the engine's
  commit protocol in Rust: ``assemble_ranks`` moves every rank's durable file into
  ``spool/step-N`` and writes ``manifest.json``; ``publish_dir`` writes ``.metadata``
  (temporary name, ``fsync``, ``rename``, directory ``fsync``) and publishes the whole
  directory as ``P`` with one ``rename`` (and ``fsync`` of both parents). Before that
  rename nothing exists at ``P``; after it, ``P`` is complete and durable. ``P`` must not
  exist, or be an empty directory.
* One engine (one arena) per rank and spool directory is kept for the life of the process
  and reused by every save, so host memory stays flat across saves; it is reopened only
  when a save needs more staging than it has. ``prepare(parent, staging_capacity=...)``
  opens it (and registers it with CUDA) at start-up, so that the first save does not pay
  for it; ``release()`` frees it.

``ShmckptReader`` reads ``.metadata`` (with a restricted unpickler: only DCP's metadata
classes), then the tensors the load plan needs of each rank file, and only those, through
the engine's ranged reader (O_DIRECT where possible, header checked against the manifest,
the CRC-32C of every tensor read verified) and copies
the requested regions into the planner's destination tensors, so DCP's resharding
(loading on another world size) works as with its own files.

Interchange: every rank file is a plain safetensors file whose tensors carry their DCP
names and whose ``__metadata__`` has DCP's ``DCP_SHARDING_INFO``, so DCP's own
``HuggingFaceStorageReader`` reads the tensors of a shmckpt checkpoint (``dcp.load`` with
``storage_reader=HuggingFaceStorageReader(P)``). DCP's ``FileSystemReader`` cannot: it
expects every item to be a ``torch.save`` stream, and fails on these files with
``ValueError: Unknown extension name='shmckpt-safetensors'`` (from the transform
descriptor every ``ShmckptStorageInfo`` carries) instead of reading wrong bytes.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import _dcp_remote, _ranged, _shmckpt, _state
from .checkpointer import _cuda_span_copy, _gc_paused, _host_tuple, _open_untrusted
from ._dcp_metadata import MAX_METADATA_BYTES as MAX_METADATA_BYTES
from ._dcp_metadata import load_metadata
from .errors import ConfigError, CorruptError, SaveFailed, TooLarge

__all__ = ["ShmckptWriter", "ShmckptReader", "ShmckptStorageInfo", "prepare", "release"]

METADATA_FILE = ".metadata"
MANIFEST_FILE = "manifest.json"
#: Spool directory (next to the checkpoint directories) where the engines write.
SPOOL_NAME = ".shmckpt-dcp"
#: Transform descriptor of every item: DCP's FileSystemReader names it in its error.
DESCRIPTOR = "shmckpt-safetensors/1"
#: Keys of the safetensors ``__metadata__`` that DCP's HuggingFaceStorageReader reads.
_HF_SHARDING_KEY = "DCP_SHARDING_INFO"
_FORMAT_KEY = "shmckpt_dcp.format"
_FILE_RE = re.compile(r"rank-(\d{5,10})-of-(\d{5,10})\.safetensors")


@dataclass
class ShmckptStorageInfo(_StorageInfo):
    """Where one DCP item is: ``relative_path`` (a rank file in the checkpoint directory),
    ``offset``/``length`` (its bytes in that file), ``tensor`` (its name in the file) and
    ``crc32c`` (CRC-32C of its bytes, as in ``manifest.json``)."""

    tensor: str = ""
    crc32c: Optional[int] = None


# -- engines ------------------------------------------------------------------------------


class _EngineSlot:
    def __init__(self, engine: Any, capacity: int, root: str):
        self.engine = engine
        self.capacity = capacity
        self.root = root


_ENGINES: Dict[Tuple[str, int, int], _EngineSlot] = {}
_ENGINES_LOCK = threading.Lock()
_SEQ: Dict[Tuple[str, int, int], int] = {}
_GEN: Dict[Tuple[str, int, int], int] = {}


def release() -> None:
    """Finish the saves in flight and free every engine (arena) ``ShmckptWriter`` opened
    in this process, and the registered read buffers of ``ShmckptReader``'s device loads.
    The next save opens a new engine."""
    with _ENGINES_LOCK:
        slots = list(_ENGINES.values())
        _ENGINES.clear()
    for s in slots:
        s.engine.close()
    _shmckpt.release_device_ring()


def prepare(
    parent: Union[str, os.PathLike],
    *,
    staging_capacity: int,
    devices: Optional[Sequence[int]] = None,
    spool: Optional[Union[str, os.PathLike]] = None,
    process_group: Any = None,
    chunk_size: Optional[int] = None,
    writer_threads: Optional[int] = None,
    queue_depth: Optional[int] = None,
    copy_threads: Optional[int] = None,
    direct_io: Optional[bool] = None,
    max_inflight_saves: Optional[int] = None,
) -> Dict[str, Any]:
    """Open this rank's engine for checkpoints published under ``parent`` now, at start-up,
    instead of in the first save: create and pre-fault its shared-memory arena of
    ``staging_capacity`` bytes (at least the rank's share of the state, plus a few MiB of
    header room) and register it with CUDA for ``devices`` (default: the current device
    when CUDA is available; ``[]`` for none). Every later ``ShmckptWriter(path)`` whose
    ``path`` is in ``parent`` (same ``spool`` and process group) reuses it, so no save
    pays these costs (seconds for many GiB: the first save of a process otherwise stalls
    that much longer). Call it on every rank, with the same arguments ``ShmckptWriter``
    gets. Returns ``{"open_s", "cuda_registration_s", "staging_capacity", "shm_name"}``.
    A save that needs more staging than this still reopens a larger engine."""
    import time

    if _dcp_remote.is_remote(parent):
        raise ConfigError(f"prepare({parent!r}): an s3:// checkpoint's engine opens at its first save")
    rank, world = _rank_world(process_group)
    parent_abs = os.path.abspath(os.fspath(parent))
    sp = os.path.abspath(os.fspath(spool)) if spool is not None else os.path.join(parent_abs, SPOOL_NAME)
    opts = dict(
        staging_capacity=staging_capacity,
        chunk_size=chunk_size,
        writer_threads=writer_threads,
        queue_depth=queue_depth,
        copy_threads=copy_threads,
        direct_io=direct_io,
        max_inflight_saves=max_inflight_saves,
    )
    t = time.perf_counter()
    slot = _open_engine(sp, rank, world, int(staging_capacity), opts)
    open_s = time.perf_counter() - t
    if devices is None:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    reg = None
    if devices:
        t = time.perf_counter()
        slot.engine.prepare_cuda([int(d) for d in devices])
        reg = time.perf_counter() - t
    return {
        "open_s": open_s,
        "cuda_registration_s": reg,
        "staging_capacity": slot.capacity,
        "shm_name": slot.engine.describe()[0],
    }


atexit.register(release)


def _remove_tree(path: str) -> None:
    """Remove a directory of ours (rename first, so it vanishes at once)."""
    import shutil

    trash = f"{path}.trash-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _rank_dir(spool: str, rank: int) -> str:
    return os.path.join(spool, f"rank-{rank:05d}")


def _clean_spool(spool: str, rank: int) -> None:
    """Leftovers of runs that died before publishing: this rank's engine roots of other
    processes, and assembly directories. Runs once per process, at this rank's first
    save: no rank of this run can have written anything the coordinator still needs
    (the first save needs this rank's file before anything is assembled)."""
    mine = f"{os.getpid()}-"
    rd = _rank_dir(spool, rank)
    if os.path.isdir(rd):
        for name in os.listdir(rd):
            p = os.path.join(rd, name)
            if not name.startswith(mine) and os.path.isdir(p) and not os.path.islink(p):
                _remove_tree(p)
    if rank == 0:
        for name in os.listdir(spool):
            p = os.path.join(spool, name)
            if (re.fullmatch(r"step-\d+", name) or ".trash-" in name) and os.path.isdir(p) and not os.path.islink(p):
                _remove_tree(p)


def _open_engine(
    spool: str, rank: int, world: int, need: int, opts: Dict[str, Any]
) -> _EngineSlot:
    """This rank's engine for ``spool``, with at least ``need`` bytes of staging.

    Each engine has its own root, ``spool/rank-KKKKK/<pid>-<generation>``: an engine
    (re)opened later never cleans up a directory another save still needs, and ranks
    never share a directory (the engine's own multi-rank commit is not used: see
    ``ShmckptWriter.finish``)."""
    key = (spool, rank, world)
    with _ENGINES_LOCK:
        slot = _ENGINES.get(key)
        if slot is not None and slot.capacity >= need:
            return slot
        if slot is not None:
            del _ENGINES[key]
        gen = _GEN.get(key, 0)
        _GEN[key] = gen + 1
    if slot is not None:
        slot.engine.close()  # finishes its saves in flight; their files stay for finish()
    remote: Dict[str, Any] = {}
    if _dcp_remote.is_remote(spool):  # `spool` is a bucket root: a remote-only engine
        root, remote = _dcp_remote.engine_root(spool, world)
    else:
        if gen == 0:
            os.makedirs(spool, exist_ok=True)
            _clean_spool(spool, rank)
        root = os.path.join(_rank_dir(spool, rank), f"{os.getpid()}-{gen}")
        os.makedirs(root, exist_ok=True)
    chunk = opts.get("chunk_size") or (8 << 20)
    cap = opts.get("staging_capacity") or 0
    cap = max(cap, -(-need // chunk) * chunk)
    engine = _shmckpt.Engine(
        root,
        rank=rank,
        world_size=world,
        staging_capacity=cap,
        chunk_size=opts.get("chunk_size"),
        writer_threads=opts.get("writer_threads"),
        queue_depth=opts.get("queue_depth"),
        copy_threads=opts.get("copy_threads"),
        direct_io=opts.get("direct_io"),
        keep_last=None,
        max_inflight_saves=opts.get("max_inflight_saves"),
        **remote,
    )
    slot = _EngineSlot(engine, int(engine.describe()[1]), root)
    with _ENGINES_LOCK:
        _ENGINES[key] = slot
    return slot


def _engine_step(path: str, world: int, seq: int) -> int:
    h = hashlib.blake2b(f"{path}\0{world}\0{seq}".encode(), digest_size=7).digest()
    return int.from_bytes(h, "little")


# -- staging ------------------------------------------------------------------------------


@dataclass
class _Item:
    index: MetadataIndex
    name: str
    nbytes: int


class _Save:
    """One save of one rank: what the engine was given and its handle."""

    def __init__(self, spool: str, step: int, path: str):
        self.spool = spool
        self.step = step
        self.path = path
        self.items: Dict[MetadataIndex, _Item] = {}
        self.handle: Any = None
        self.file = ""
        self.rank = 0
        self.world = 1
        #: The flattened tensors stage() was given (identity check in write_data).
        self.leaves: Dict[str, Any] = {}
        #: With several ranks: which rank writes each planned item (see ``_assign_owners``);
        #: this rank staged only its own. ``None``: every item of this rank was staged.
        self.owners: Optional[Dict[Tuple[str, Any], int]] = None

    def matches(self, planned: Any) -> bool:
        """Whether DCP is saving the state this save staged: the planner's flattened
        state dict holds the very tensor objects stage() saw."""
        if not isinstance(planned, dict):
            return True  # a planner without a flat state dict: cannot tell
        common = [k for k in self.leaves if k in planned]
        return bool(common) and all(planned[k] is self.leaves[k] for k in common)

    @property
    def step_dir(self) -> str:
        return os.path.join(self.spool, f"step-{self.step}")


def _offsets_of(index: MetadataIndex) -> List[int]:
    return [int(x) for x in index.offset] if index.offset is not None else []


def _item_bytes(obj: Any) -> int:
    """Bytes of a planned item's data: a tensor, or the serialized bytes of a value."""
    return int(obj.numel() * obj.element_size()) if isinstance(obj, torch.Tensor) else len(obj)


def _key(index: MetadataIndex) -> Tuple[str, Any]:
    """What identifies a planned item across ranks (``MetadataIndex`` equality: fqn and
    offset)."""
    return (index.fqn, tuple(int(x) for x in index.offset) if index.offset is not None else None)


#: ranks -> (the default group it was made under, the gloo group)
_GATHER_GROUPS: Dict[Tuple[int, ...], Tuple[Any, Any]] = {}
_GATHER_LOCK = threading.Lock()


def _gather_group(group: Any) -> Any:
    """A gloo group of the same ranks as ``group`` (DCP's), for ``stage()``'s exchange of
    item lists: a collective on DCP's own group could interleave with the collectives of
    a previous save still uploading in DCP's thread. Made once per set of ranks (and
    again after the default group was destroyed and made anew), by those ranks only
    (``use_local_synchronization``)."""
    world = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else world))
    with _GATHER_LOCK:
        made = _GATHER_GROUPS.get(ranks)
        if made is None or made[0] is not world:
            made = (world, dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True))
            _GATHER_GROUPS[ranks] = made
        return made[1]


def _assign_owners(gathered: Sequence[Sequence[Tuple[Tuple[str, Any], int]]]) -> Dict[Tuple[str, Any], int]:
    """Given every rank's items (key, bytes), in rank order, pick the one rank that writes
    each item: an item on several ranks (a replicated tensor or value) goes to the rank
    with the fewest bytes assigned so far (the lowest such rank on a tie), the way DCP's
    planner de-duplicates. Deterministic: every rank computes the same from the same
    lists."""
    ranks_of: Dict[Tuple[str, Any], List[int]] = {}
    size_of: Dict[Tuple[str, Any], int] = {}
    for r, items in enumerate(gathered):
        for key, nbytes in items:
            ranks_of.setdefault(key, []).append(r)
            size_of[key] = nbytes
    assigned = [0] * len(gathered)
    owners: Dict[Tuple[str, Any], int] = {}
    for key, ranks in ranks_of.items():
        pick = min(ranks, key=lambda r: (assigned[r], r))
        assigned[pick] += size_of[key] or 1
        owners[key] = pick
    return owners


def _check_target(path: str) -> None:
    if _dcp_remote.is_remote(path):
        _dcp_remote.check_target(path)
        return
    if os.path.lexists(path):
        if os.path.islink(path) or not os.path.isdir(path) or os.listdir(path):
            raise FileExistsError(
                f"{path}: the checkpoint directory exists and is not empty; ShmckptWriter "
                "publishes a checkpoint with one rename and never overwrites one"
            )


def _rank_world(group: Any) -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _entry_bound(name: str, ndim: int) -> int:
    """An upper bound of one item's entry in the safetensors header."""
    return 2 * len(name.encode()) + 96 + 24 * ndim


def _estimate_file(items_header: int, data: int, meta: Dict[str, str]) -> int:
    """An upper bound of the safetensors file the engine will lay out: ``data`` bytes of
    items, whose header entries take at most ``items_header`` bytes (the sum of their
    ``_entry_bound``), and the metadata ``meta``."""
    header = 8 + 4096 + len(json.dumps(meta)) * 2 + items_header
    return data + -(-header // 4096) * 4096


class ShmckptWriter(StorageWriter, AsyncStager):
    """DCP ``StorageWriter`` and ``AsyncStager`` writing through shmckpt's engine.

    ``path``: the checkpoint directory (must not exist, or be empty; its parent must be
    writable and on the same filesystem as the spool). Keyword arguments are engine
    settings (``staging_capacity``: at least this many bytes of shared-memory staging,
    default the size of the rank's file; ``chunk_size``, ``writer_threads``,
    ``queue_depth``, ``copy_threads``, ``direct_io``, ``max_inflight_saves``).
    ``spool``: where the engines write before publishing (default
    ``dirname(path)/.shmckpt-dcp``). ``process_group``: the group given to DCP, when not
    the default one.

    Use ``async_checkpointer_type=THREAD`` (DCP's default): the engine already writes off
    the trainer's thread, and an engine cannot move to another process.
    """

    _synchronize_after_execute: bool = False  # stage() returns once staged

    def __init__(
        self,
        path: Union[str, os.PathLike],
        *,
        spool: Optional[Union[str, os.PathLike]] = None,
        process_group: Any = None,
        staging_capacity: Optional[int] = None,
        chunk_size: Optional[int] = None,
        writer_threads: Optional[int] = None,
        queue_depth: Optional[int] = None,
        copy_threads: Optional[int] = None,
        direct_io: Optional[bool] = None,
        max_inflight_saves: Optional[int] = None,
    ):
        super().__init__()
        self.path = _dcp_remote.norm(path)
        self._spool = os.path.abspath(os.fspath(spool)) if spool is not None else None
        self._group = process_group
        self._opts = dict(
            staging_capacity=staging_capacity,
            chunk_size=chunk_size,
            writer_threads=writer_threads,
            queue_depth=queue_depth,
            copy_threads=copy_threads,
            direct_io=direct_io,
            max_inflight_saves=max_inflight_saves,
        )
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self._staged: Deque[_Save] = collections.deque()
        self._current: Optional[_Save] = None
        self._lock = threading.Lock()
        self.last_report: Optional[Dict[str, Any]] = None
        #: Where the last ``stage()`` spent its time: ``items_s`` (flattening the state and
        #: listing its items, with the owner exchange on several ranks), ``submit_s`` (the
        #: engine's staging call, device-to-host copies included), ``total_s``, and
        #: ``engine`` (the engine's own staged report: ``staging``, ``backpressure``,
        #: ``registration`` seconds).
        self.last_stage: Dict[str, Any] = {}
        # True once DCP gave a checkpoint_id: stage() then does not know the next target
        # (DCP resets the writer after staging) and leaves the check to the coordinator.
        self._path_from_reset = False

    def __getstate__(self) -> Any:
        raise TypeError(
            "ShmckptWriter cannot be pickled (its engine and staged data live in this "
            "process): use async_save's default THREAD checkpointer type"
        )

    # -- StorageWriter ---------------------------------------------------------------------
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id:
            self.path = _dcp_remote.norm(checkpoint_id)
            self._path_from_reset = True
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if is_coordinator:
            _check_target(self.path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        """With ``async_save`` on several ranks, each replicated item was staged by one
        rank only (``stage``): give every planned item to the plan of the rank that staged
        it. Plans that do not match a staged save (``dcp.save``) are left as DCP made
        them."""
        planned: Dict[Tuple[str, Any], Any] = {}
        for p in plans:
            for wi in p.items:
                planned.setdefault(_key(wi.index), wi)
        with self._lock:
            owners = next(
                (sv.owners for sv in self._staged if sv.owners is not None and set(sv.owners) == set(planned)),
                None,
            )
        if owners is None or any(r >= len(plans) for r in owners.values()):
            return plans
        return [
            dataclasses.replace(p, items=[wi for k, wi in planned.items() if owners[k] == r]) for r, p in enumerate(plans)
        ]

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory (DCP's ``checkpoint_id``)."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        """Whether ``checkpoint_id`` is a path this writer can save to (DCP asks)."""
        try:
            os.fspath(checkpoint_id)
        except TypeError:
            return False
        return True

    # -- staging ---------------------------------------------------------------------------
    def _begin(self) -> Tuple[_Save, int, int]:
        rank, world = _rank_world(self._group)
        if _dcp_remote.is_remote(self.path):
            # The bucket root is the engine's "spool"; the engine step is the path's N.
            spool, step = _dcp_remote.split(self.path)
            _dcp_remote.agree_session(spool, world, self._group)
            save = _Save(spool, step, self.path)
            save.rank, save.world = rank, world
            return save, rank, world
        spool = self._spool or os.path.join(os.path.dirname(self.path), SPOOL_NAME)
        key = (spool, rank, world)
        with _ENGINES_LOCK:
            seq = _SEQ.get(key, 0)
            _SEQ[key] = seq + 1
        save = _Save(spool, _engine_step(spool, world, seq), self.path)
        save.rank, save.world = rank, world
        return save, rank, world

    def _submit(self, save: _Save, rank: int, world: int, objs: List[Tuple[MetadataIndex, Any]]) -> None:
        """Hand ``objs`` (tensors, or bytes of non-tensor items) to the engine and return
        once they are staged. One pass over the items builds the engine's tuples, the
        header's sharding entries and the file estimate (the caller's stall)."""
        names: Dict[str, MetadataIndex] = {}
        sharding: Dict[str, Any] = {}
        # Engine tuples (name, dtype, shape, address, nbytes, device; device -1 for host
        # memory) and, at the same index, what keeps each one's memory alive.
        tuples: List[Tuple[str, str, List[int], int, int, int]] = []
        keep: List[Any] = []
        streams: Dict[int, Any] = {}
        finishes: List[Tuple[int, Any]] = []  # (index in tuples, finish) for host copies
        header = 0  # the header estimate's per-item part (see _estimate_file)
        data = 0
        for index, obj in objs:
            name = index.fqn
            if name in names:  # a second shard of one tensor on this rank
                name = f"{index.fqn}@{','.join(map(str, _offsets_of(index)))}"
                if name in names:
                    raise ValueError(f"ShmckptWriter: item {index} is planned twice")
            names[name] = index
            if not isinstance(obj, torch.Tensor):
                nbytes = len(obj)
                sharding[name] = {"saved_offsets": [0]}
                save.items[index] = _Item(index, name, nbytes)
                header += _entry_bound(name, 1)
                data += nbytes
                a = np.frombuffer(obj, dtype=np.uint8) if nbytes else np.empty(0, np.uint8)
                tuples.append(_host_tuple(name, "U8", a))
                keep.append(a)
                continue
            t = obj.detach()
            # Refuse what has no values in memory; a conjugate or negative view is staged
            # by value (resolved on the host: its memory is not its values).
            _state.check_tensor(t, name, "ShmckptWriter: ")
            lazy = _state.is_lazy(t)
            if lazy and t.is_cpu:
                t = _state.resolved(t)
            shape = list(t.shape)
            nbytes = t.numel() * t.element_size()
            sharding[name] = {"saved_offsets": _offsets_of(index) or [0] * len(shape)}
            save.items[index] = _Item(index, name, nbytes)
            header += _entry_bound(name, len(shape))
            data += nbytes
            st = _state.TORCH_TO_ST.get(t.dtype)
            if st is None:
                raise TypeError(f"ShmckptWriter: {name!r} has dtype {t.dtype}, which safetensors cannot store")
            if t.is_cpu:
                if not t.is_contiguous():
                    t = t.contiguous()
                tuples.append(_host_tuple(name, st, t))
                keep.append(t)
            elif t.is_cuda:
                dev = t.get_device()
                if dev not in streams:
                    streams[dev] = torch.cuda.current_stream(dev)
                if nbytes == 0:
                    tuples.append((name, st, shape, 0, 0, -1))
                    keep.append(t)
                elif t.is_contiguous() and not lazy:
                    tuples.append((name, st, shape, int(t.data_ptr()), nbytes, dev))
                    keep.append(t)
                else:
                    # A strided or lazy view: copy its storage span to pinned host memory
                    # (no device memory), then gather (and apply the bits) on the host.
                    with torch.cuda.device(dev):
                        pinned, fin = _cuda_span_copy(t)
                    tuples.append((name, st, shape, 0, 0, -1))
                    keep.append([t, pinned])
                    finishes.append((len(tuples) - 1, fin))
            else:
                raise TypeError(f"ShmckptWriter: {name!r} is on {t.device}; only CPU and CUDA tensors are supported")
        meta = {
            _HF_SHARDING_KEY: json.dumps(sharding, separators=(",", ":")),
            "DCP_VERSION": "1.0",
            "format": "pt",
            _FORMAT_KEY: "1",
        }
        need = _estimate_file(header, data, meta)
        slot = _open_engine(save.spool, rank, world, need, self._opts)
        if finishes:
            for s in streams.values():
                s.synchronize()  # those streams only, not the device
            for i, fin in finishes:
                h = fin()
                tuples[i] = _host_tuple(tuples[i][0], tuples[i][1], h)
                keep[i] = [keep[i], h]
        after = [(d, "stream", s.cuda_stream) for d, s in streams.items()]
        try:
            h = slot.engine.save(save.step, tuples, meta, after, True)
        except TooLarge:
            # The header estimate was short: reopen with twice the room and retry once.
            slot = _open_engine(save.spool, rank, world, 2 * need + (16 << 20), self._opts)
            h = slot.engine.save(save.step, tuples, meta, after, True)
        # save() returned: every byte is staged, `keep` (our references) may go.
        save.handle = h
        self.last_stage["engine"] = h.wait_staged()  # returns at once: staged already

    def stage(self, state_dict: Dict[str, Any], **kwargs: Any) -> Dict[str, Any]:
        """Copy every tensor of ``state_dict`` (local shards of DTensors) into the engine's
        shared-memory arena and start writing; return once staged. Non-tensor values are
        serialized now. Returns the state dict for DCP's planning (its tensors are not read
        again)."""
        t0 = time.perf_counter()
        self.last_stage = {}
        if not self._path_from_reset:
            _check_target(self.path)  # early: before anything is staged
        # No cyclic GC while the per-item objects are built (as in Checkpointer.save):
        # collections of the trainer's whole heap would land in the caller's stall.
        with _gc_paused():
            return self._stage(state_dict, t0)

    def _stage(self, state_dict: Dict[str, Any], t0: float) -> Dict[str, Any]:
        """``stage`` with collections paused; ``t0``: when ``stage`` was called."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
        from torch.distributed.checkpoint.planner_helpers import _create_write_items
        from torch.distributed.checkpoint.utils import find_state_dict_object
        from torch.distributed.tensor import DTensor

        save, rank, world = self._begin()
        flat, _ = flatten_state_dict(state_dict)
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        if any(isinstance(v, ShardedTensor) for v in flat.values()):
            flat = _flatten_sharded_tensors(flat)
        objs: List[Tuple[MetadataIndex, Any]] = []
        plain = (torch.Tensor, torch.nn.Parameter)
        for fqn, obj in flat.items():
            if type(obj) in plain:
                # A plain tensor is one item at offset 0, itself (what DCP's helpers below
                # find for it, without their per-object protocol checks: ~45 µs a tensor).
                save.leaves[fqn] = obj
                objs.append((MetadataIndex(fqn, torch.Size([0] * obj.dim())), obj))
                continue
            if isinstance(obj, torch.Tensor):
                save.leaves[fqn] = obj
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            for wi in _create_write_items(fqn, obj):
                data = find_state_dict_object(flat, wi.index)
                if wi.type == WriteItemType.BYTE_IO:
                    buf = io.BytesIO()
                    torch.save(data, buf)
                    data = buf.getvalue()
                objs.append((wi.index, data))
        if world > 1 and dist.is_available() and dist.is_initialized():
            # Planning (and DCP's de-duplication of replicated items) comes after staging:
            # agree now on which rank writes each item, so that a replicated tensor is
            # staged and written once, not once per rank (prepare_global_plan then gives
            # the planned items to the same ranks).
            mine = [(_key(i), _item_bytes(d)) for i, d in objs]
            gathered: List[Any] = [None] * world
            dist.all_gather_object(gathered, mine, group=_gather_group(self._group))
            save.owners = _assign_owners(gathered)
            objs = [(i, d) for i, d in objs if save.owners[_key(i)] == rank]
        t1 = time.perf_counter()
        self._submit(save, rank, world, objs)
        t2 = time.perf_counter()
        with self._lock:
            self._staged.append(save)
        out = _copy_containers(state_dict)
        self.last_stage.update(items_s=t1 - t0, submit_s=t2 - t1, total_s=time.perf_counter() - t0)
        return out

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once staged."""

    def close(self) -> None:
        """Nothing to release per writer (the engine is shared; see ``release()``)."""

    # -- writing ---------------------------------------------------------------------------
    def _take_staged(self, planned: Any) -> Optional[_Save]:
        """The staged save DCP is now writing. Saves staged before it whose upload failed
        before reaching write_data (DCP raised in planning) are dropped, with their files,
        so a reused writer never publishes an older snapshot under a newer name."""
        with self._lock:
            staged = list(self._staged)
            pick = next((i for i, sv in enumerate(staged) if sv.matches(planned)), None)
            if pick is None:
                if staged:
                    raise RuntimeError(
                        "ShmckptWriter: DCP is saving tensors that stage() did not stage (a "
                        "planner that replaces them?); stage() supports DCP's default planning"
                    )
                stale, save = [], None
            else:
                for _ in range(pick + 1):
                    self._staged.popleft()
                stale, save = staged[:pick], staged[pick]
        for sv in stale:
            try:
                sv.handle.wait()
            except BaseException:
                pass
            for d in _sources(sv, sv.rank):
                _remove_tree(d)
        return save

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        save = self._take_staged(getattr(planner, "state_dict", None))
        if save is None:
            # dcp.save (no stage): resolve the planned items now and stage them.
            _check_target(self.path)
            save, rank, world = self._begin()
            objs = []
            for wi in plan.items:
                data = planner.resolve_data(wi)
                if wi.type == WriteItemType.BYTE_IO:
                    data = data.getvalue()
                objs.append((wi.index, data))
            self._submit(save, rank, world, objs)
        self._current = save
        report = save.handle.wait()  # this rank's file and manifest part are durable
        if _dcp_remote.is_remote(save.path):
            report = dict(report, remote=_dcp_remote.wait_committed(save.handle))
        self.last_report = report
        save.file = os.path.basename(report["file"])
        results = []
        missing = []
        for wi in plan.items:
            it = save.items.get(wi.index)
            if it is None:
                missing.append(wi.index)
                continue
            results.append(
                WriteResult(
                    index=wi.index,
                    size_in_bytes=it.nbytes,
                    storage_data=ShmckptStorageInfo(
                        relative_path=save.file,
                        offset=0,
                        length=it.nbytes,
                        transform_descriptors=[DESCRIPTOR],
                        tensor=it.name,
                    ),
                )
            )
        if missing:
            raise RuntimeError(
                f"ShmckptWriter: the save plan writes items that stage() did not stage "
                f"(a planner other than DCP's default layout?): {missing[:5]}"
            )
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """DCP's coordinator, once every rank's file is durable: commit the ranks and
        publish the checkpoint, through the engine's commit protocol in Rust
        (``shmckpt::commit::assemble_ranks`` moves every rank's file into
        ``spool/step-N`` and writes ``manifest.json``; ``publish_dir`` writes
        ``.metadata`` and renames the directory to ``self.path``). Python writes no
        manifest and renames no file of the checkpoint."""
        save = self._current
        if save is None:
            raise SaveFailed("ShmckptWriter.finish called before write_data")
        if _dcp_remote.is_remote(save.path):
            # Committed in the bucket (write_data waited); .metadata completes it.
            metadata.storage_data = _dcp_remote.storage_entries(save.path, results, ShmckptStorageInfo)
            metadata.storage_meta = self.storage_meta()
            _dcp_remote.publish_metadata(save.path, pickle.dumps(metadata))
            self._current = None
            return
        step_dir, sources = self._assemble(save, metadata, results)
        _check_target(self.path)
        # One rename makes the complete checkpoint appear at self.path.
        _shmckpt.publish_dir(step_dir, [(METADATA_FILE, pickle.dumps(metadata))], self.path)
        self._current = None
        for d in sources:  # the ranks' emptied partial directories
            _remove_tree(d)

    def _assemble(self, save: "_Save", metadata: Metadata, results: List[List[WriteResult]]) -> Tuple[str, List[str]]:
        """The coordinator's half of a commit before publishing: every rank's durable part
        of ``save`` assembled into ``save.step_dir`` by the Rust protocol
        (``shmckpt::commit::assemble_ranks``: parts checked, files moved, ``manifest.json``
        written), and ``metadata`` given each item's offset, length and CRC-32C from it.
        Returns the assembled directory and the ranks' emptied partial directories."""
        sources = []
        for k in range(save.world):
            src = _sources(save, k)
            if len(src) != 1:
                raise SaveFailed(
                    f"{save.spool}: rank {k}'s file of this save is {'missing' if not src else 'ambiguous'} "
                    f"({src}); did every rank save with a ShmckptWriter on the same spool?"
                )
            sources.append(src[0])
        step_dir = save.step_dir
        _step, files = _shmckpt.assemble_ranks(sources, step_dir, save.step, self.path, {_FORMAT_KEY: "1"})
        by_file = {f: {name: (start, b, e, crc) for name, b, e, crc in tensors} for f, start, tensors in files}
        storage_md: Dict[MetadataIndex, ShmckptStorageInfo] = {}
        for wr_list in results:
            for wr in wr_list:
                info = wr.storage_data
                ent = by_file.get(info.relative_path, {}).get(info.tensor)
                if ent is None:
                    raise CorruptError(
                        f"{os.path.join(step_dir, MANIFEST_FILE)}: no tensor {info.tensor!r} in {info.relative_path}"
                    )
                start, b, e, crc = ent
                storage_md[wr.index] = dataclasses.replace(info, offset=start + b, length=e - b, crc32c=int(crc))
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        try:
            from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

            metadata.version = CURRENT_DCP_VERSION
        except ImportError:  # pragma: no cover - older torch
            pass
        return step_dir, sources


def _sources(save: _Save, rank: int) -> List[str]:
    """Where ``rank``'s engine left its file of ``save``: ``step-N.partial`` (several
    ranks: the engine waits for the other parts, which never come to its own root) or the
    committed ``step-N`` (one rank)."""
    rd = _rank_dir(save.spool, rank)
    name = f"step-{save.step}.partial" if save.world > 1 else f"step-{save.step}"
    try:
        roots = sorted(os.listdir(rd))
    except FileNotFoundError:
        return []
    return [os.path.join(rd, r, name) for r in roots if os.path.isdir(os.path.join(rd, r, name))]


def _copy_containers(x: Any) -> Any:
    """New dicts and lists around the same leaves (DCP plans from this copy while the
    trainer may change its own containers)."""
    if isinstance(x, dict):
        return {k: _copy_containers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy_containers(v) for v in x]
    return x


# -- reading ------------------------------------------------------------------------------

def _load_metadata(path: str) -> Metadata:
    """DCP's Metadata from ``path``, through the restricted unpickler of
    ``_dcp_metadata`` (a crafted pickle can neither name nor change anything outside
    DCP's metadata classes)."""
    try:
        f = _open_untrusted(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no DCP metadata: not a checkpoint directory, or its save did not finish"
        ) from None
    with f:
        return load_metadata(path, f, (ShmckptStorageInfo,))


class ShmckptReader(StorageReader):
    """DCP ``StorageReader`` for checkpoints written by :class:`ShmckptWriter`.

    ``direct_io``: read with O_DIRECT where the filesystem allows (default). Of each rank
    file the load plan needs, only the tensors of the plan are read (each whole, once, its
    CRC-32C verified; ``shmckpt._ranged``). A planned item
    that is a whole stored tensor of the same dtype bound for a contiguous tensor (the
    usual case when the world size is unchanged) is copied into it as the file is read:
    from registered read buffers for a CUDA tensor (O_DIRECT reads and host-to-device
    copies overlap), from the same buffers for a CPU one. The other items (regions of a
    stored tensor when resharding, bytes values, dtype conversions, strided destinations)
    come back in buffers of their own and are copied into place. ``last_read`` counts the
    items of each path (``device_items``, ``direct_host_items``, ``host_items``)."""

    def __init__(self, path: Union[str, os.PathLike], *, direct_io: bool = True):
        super().__init__()
        self.path = _dcp_remote.norm(path)
        self.direct_io = direct_io
        self.storage_data: Dict[MetadataIndex, ShmckptStorageInfo] = {}
        self._md: Optional[Metadata] = None
        self.load_id = uuid.uuid4().hex
        #: What the last ``read_data`` did: rank files read, items copied straight into
        #: CUDA tensors (registered read buffers) and into CPU tensors, items that came
        #: through buffers of their own.
        self.last_read: Optional[Dict[str, int]] = None
        #: What the last ``read_data`` read: ``bytes`` from the rank files' data sections
        #: (only the plan's tensors, gaps of at most 128 KiB between them and O_DIRECT page
        #: padding included) and ``reads`` issued.
        self.last_read_io: Optional[Dict[str, int]] = None

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = _dcp_remote.norm(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self) -> Metadata:
        """DCP's Metadata of this checkpoint (the one ``.metadata`` every rank reads).

        Takes no ``rank``/``**kwargs`` on purpose: DCP's ``load`` calls a reader whose
        ``read_metadata`` accepts ``kwargs`` a second time with ``rank=`` when the first
        call failed, and a rank whose second call succeeds then leaves DCP's collectives
        (``use_collectives=False``: it ends with a barrier where the other ranks
        all-gather), which hangs every rank. Without it a failed read fails the load on
        every rank."""
        if _dcp_remote.is_remote(self.path):
            with _dcp_remote.read_metadata_bytes(self.path, MAX_METADATA_BYTES) as f:
                md = load_metadata(f"{self.path}/{METADATA_FILE}", f, (ShmckptStorageInfo,))
        else:
            md = _load_metadata(os.path.join(self.path, METADATA_FILE))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        sd = metadata.storage_data
        if not isinstance(sd, dict):
            raise CorruptError(f"{self.path}/{METADATA_FILE}: storage_data is not a mapping")
        for k, v in sd.items():
            if not isinstance(v, ShmckptStorageInfo):
                raise CorruptError(
                    f"{self.path}: item {k.fqn!r} was not written by ShmckptWriter "
                    f"({type(v).__name__}); read this checkpoint with DCP's FileSystemReader"
                )
            if not _FILE_RE.fullmatch(v.relative_path or ""):
                raise CorruptError(f"{self.path}: item {k.fqn!r} names file {v.relative_path!r}, not a rank file")
        self.storage_data = sd
        self._md = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory (DCP's ``checkpoint_id``)."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        """Whether ``checkpoint_id`` is a directory holding a DCP checkpoint written by
        :class:`ShmckptWriter` (its metadata and the committed manifest; DCP asks)."""
        try:
            p = os.fspath(checkpoint_id)
        except TypeError:
            return False
        if _dcp_remote.is_remote(p):
            return _dcp_remote.is_checkpoint(p, MAX_METADATA_BYTES)
        return os.path.isfile(os.path.join(p, METADATA_FILE)) and os.path.isfile(os.path.join(p, MANIFEST_FILE))

    def _direct(self, req: Any, target: torch.Tensor) -> bool:
        """Whether ``req`` can go straight from the file into ``target``: a whole stored
        item (no resharding region) of the same dtype into a contiguous CPU or CUDA tensor
        of exactly its bytes. Never a conjugate or negative view: its memory holds other
        values than it reads as, so such targets are filled through ``copy_``."""
        if req.type != LoadItemType.TENSOR or target.device.type not in ("cpu", "cuda") or not target.is_contiguous():
            return False
        if _dcp_remote.is_remote(self.path):
            return False  # bucket reads come back in buffers of their own
        if _state.is_lazy(target):
            return False
        if target.numel() == 0 or any(int(o) != 0 for o in req.storage_offsets):
            return False
        info = self.storage_data[req.storage_index]
        md = self._md.state_dict_metadata.get(req.storage_index.fqn) if self._md is not None else None
        dtype = getattr(getattr(md, "properties", None), "dtype", None)
        return (
            dtype == target.dtype
            and list(target.size()) == [int(n) for n in req.lengths]
            and target.numel() * target.element_size() == info.length
        )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: Dict[str, List[Any]] = {}
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if info is None:
                raise CorruptError(f"{self.path}: the metadata has no storage entry for {req.storage_index}")
            per_file.setdefault(info.relative_path, []).append(req)
        stats = {"files": 0, "device_items": 0, "direct_host_items": 0, "host_items": 0}
        io_totals = {"bytes": 0, "reads": 0}
        bucket = _dcp_remote.RankReader(self.path) if _dcp_remote.is_remote(self.path) else None
        for rel, reqs in per_file.items():
            m = _FILE_RE.fullmatch(rel)
            assert m is not None  # checked in set_up_storage_reader
            rank = int(m.group(1))
            for name in (rel, MANIFEST_FILE):
                if os.path.islink(os.path.join(self.path, name)):
                    raise CorruptError(f"{os.path.join(self.path, name)}: is a symbolic link; refusing to follow it")
            # Whole items bound for contiguous tensors are copied into them as the file is
            # read (CUDA ones from registered buffers, no pageable copy); the rest comes
            # back in buffers of its own and is copied into place below.
            targets: Dict[int, torch.Tensor] = {}
            direct: Dict[str, Tuple[Any, torch.Tensor]] = {}
            device: List[Tuple[str, int, int, int]] = []
            host: List[Tuple[str, int, int]] = []
            for k, req in enumerate(reqs):
                if req.type == LoadItemType.BYTE_IO:
                    continue
                target = planner.resolve_tensor(req).detach()
                targets[k] = target
                tname = self.storage_data[req.storage_index].tensor
                if tname not in direct and self._direct(req, target):
                    direct[tname] = (req, target)
                    nb = target.numel() * target.element_size()
                    if target.is_cuda:
                        device.append((tname, int(target.data_ptr()), nb, target.device.index))
                    else:
                        host.append((tname, int(target.data_ptr()), nb))
            if device:
                for dev in {d for *_, d in device}:
                    torch.cuda.current_stream(dev).synchronize()  # queued work on the targets
            if bucket is not None:
                file, _meta, tensors = bucket.read(rank)
            else:
                # Only the tensors of this plan are read (each whole, CRC-32C verified).
                file, tensors = _ranged.read_plan_items(
                    self.path,
                    rank,
                    (self.storage_data[r.storage_index].tensor for r in reqs),
                    device,
                    host,
                    direct_io=self.direct_io,
                    totals=io_totals,
                )
            if file != rel:
                raise CorruptError(
                    f"{self.path}: the manifest names {file!r} for rank {rank}, the DCP metadata {rel!r}"
                )
            stats["files"] += 1
            by_name = {t[0]: t for t in tensors}
            for k, req in enumerate(reqs):
                info = self.storage_data[req.storage_index]
                t = by_name.get(info.tensor)
                where = f"{os.path.join(self.path, rel)}: {req.storage_index.fqn!r}"
                if t is None:
                    raise CorruptError(f"{where}: tensor {info.tensor!r} is not in the file")
                name, st, shape, crc, offset, nbytes, buf = t
                if (info.crc32c is not None and info.crc32c != crc) or info.offset != offset or info.length != nbytes:
                    raise CorruptError(
                        f"{where}: the DCP metadata (offset {info.offset}, {info.length} bytes, "
                        f"CRC {info.crc32c}) disagrees with the manifest (offset {offset}, "
                        f"{nbytes} bytes, CRC {crc})"
                    )
                sent = direct.get(info.tensor)
                if sent is not None and sent[0] is req:
                    stats["device_items" if sent[1].is_cuda else "direct_host_items"] += 1
                    planner.commit_tensor(req, targets[k])
                    continue
                # A second request for an item already sent to the device is copied from
                # there (device to device).
                src = sent[1] if buf is None and sent is not None else None
                if buf is None and src is None:
                    raise CorruptError(f"{where}: tensor {info.tensor!r} came back without its bytes")
                stats["host_items"] += 1
                if req.type == LoadItemType.BYTE_IO:
                    data = bytes(np.asarray(buf)) if nbytes else b""
                    planner.load_bytes(req, io.BytesIO(data))
                    continue
                dt = _state.ST_TO_TORCH.get(st)
                if dt is None:
                    raise CorruptError(f"{where}: dtype {st} has no torch dtype")
                if src is not None:
                    src = src.reshape(shape)
                elif nbytes == 0:
                    src = torch.empty(shape, dtype=dt)
                else:
                    src = torch.from_numpy(np.asarray(buf)).view(dt).reshape(shape)
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    src = src.narrow(d, int(o), int(n))
                target = targets[k]
                if target.size() != src.size():
                    raise CorruptError(
                        f"{where}: the plan wants a region of {tuple(target.size())}, the file holds {tuple(src.size())}"
                    )
                target.copy_(src)
                planner.commit_tensor(req, target)
        self.last_read = stats
        self.last_read_io = io_totals
        fut: Future = Future()
        fut.set_result(None)
        return fut
