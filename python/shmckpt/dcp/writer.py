"""``ShmckptWriter``: DCP's ``StorageWriter`` and ``AsyncStager`` through shmckpt's engine."""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import threading
import uuid
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple, Union

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import _shmckpt
from ..config import Tuning, tuning_of
from ..errors import ConfigError, CorruptError, SaveFailed
from .divergence import DcpReplicaCheck, local_unplanned
from .engines import SESSION, _rank_world, _remove_tree, _sources
from .items import _check_target, _key, _Save
from .staging import StagingMixin
from .storage import _FORMAT_KEY, DESCRIPTOR, MANIFEST_FILE, METADATA_FILE, ShmckptStorageInfo
from . import bucket as _dcp_remote


def write_results(save: Any, items: Sequence[Any], who: str) -> List[WriteResult]:
    """DCP's ``WriteResult`` of each planned item of ``save`` (one rank's staged save, its
    file named): every item is a whole tensor of that file. An item the save did not
    stage is a :class:`SaveFailed` naming ``who`` (the writer)."""
    results = []
    missing = []
    for wi in items:
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
        raise SaveFailed(
            f"{who}: the save plan writes items that stage() did not stage "
            f"(a planner other than DCP's default layout?): {missing[:5]}"
        )
    return results


#: The keyword arguments of ``ShmckptWriter`` (the flat tuning ones of earlier versions aside).
_WRITER_KEYWORDS = ("overwrite", "spool", "process_group", "tuning", "check_replicas", "on_divergence")


class ShmckptWriter(StagingMixin, StorageWriter, AsyncStager):
    """DCP ``StorageWriter`` and ``AsyncStager`` writing through shmckpt's engine.

    ``path``: the checkpoint directory (its parent must be writable and on the same
    filesystem as the spool). ``overwrite`` (default ``True``, as DCP's
    ``FileSystemWriter``): a save into a directory that holds a DCP checkpoint (a
    ``.metadata``) replaces it atomically: the new checkpoint is complete and durable
    before one ``renameat2(RENAME_EXCHANGE)`` swaps it in, so a crash leaves the old one or
    the new one loadable, never neither; then the old one is removed. A non-empty
    directory without ``.metadata`` is never replaced; ``overwrite=False`` refuses any
    non-empty directory (``FileExistsError``). An ``s3://`` path never overwrites.
    ``tuning``: the engine settings, a :class:`shmckpt.Tuning` (its ``staging_capacity``:
    at least this many bytes of shared-memory staging, default the size of the rank's
    file); the flat tuning keywords of earlier versions (``chunk_size=``, ...) are
    accepted, deprecated.
    ``spool``: where the engines write before publishing (default
    ``dirname(path)/.shmckpt-dcp``). ``process_group``: the group given to DCP, when not
    the default one.

    ``check_replicas=group`` (a process group of data-parallel ranks) and
    ``on_divergence`` (``"raise"``, ``"warn"`` or a callable): the Checkpointer's replica
    divergence check for each save (``shmckpt.dcp.divergence``; docs/guarantees.md): the
    ranks of ``group`` compare the CRC-32C of every tensor they all hold (replicated
    items, which DCP writes on one rank only, are checksummed on the others when the
    state is snapshotted); a divergent checkpoint is not published
    (``ReplicaDivergence`` naming tensor and ranks, inside DCP's ``CheckpointException``)
    unless ``on_divergence`` says so.

    Both of ``async_save``'s checkpointer types work. THREAD (DCP's default): DCP plans
    and commits in a thread of the trainer. PROCESS: the writer is pickled to DCP's
    checkpoint process as its configuration; ``stage()`` still copies into this
    process's engine, whose writers write the file, and the checkpoint process receives
    the plan view of the staged state (shapes, no bytes: see ``StagedState``), plans,
    and commits; it opens an engine of its own (its own root in the spool, its own rank
    lock) only for a save that was not staged by a ``ShmckptWriter``, and frees it when
    it ends (``atexit``, or ``SIGTERM`` from the trainer's exit). With
    ``check_replicas``, the check runs in the trainer when the staged state is handed
    over (DCP's executor thread, before the file is waited for); a save the checkpoint
    process would stage itself is refused (``SaveFailed``): the group stays behind.
    """

    _synchronize_after_execute: bool = False  # stage() returns once staged

    def __init__(
        self,
        path: Union[str, os.PathLike],
        overwrite: bool = True,
        *,
        spool: Optional[Union[str, os.PathLike]] = None,
        process_group: Any = None,
        tuning: Optional[Tuning] = None,
        check_replicas: Any = None,
        on_divergence: Any = "raise",
        **legacy: Any,
    ):
        super().__init__()
        #: The engine settings (:class:`shmckpt.Tuning`; its ``staging_capacity`` a minimum).
        self._opts = tuning_of("ShmckptWriter", tuning, legacy, _WRITER_KEYWORDS)
        self.path = _dcp_remote.norm(path)
        #: The replica divergence check (``check_replicas``), or None.
        self._check: Optional[DcpReplicaCheck] = None
        if check_replicas is not None:
            if _dcp_remote.is_remote(self.path):
                raise ConfigError("check_replicas is not supported for s3:// checkpoints yet")
            self._check = DcpReplicaCheck(check_replicas, on_divergence, process_group)
        self._overwrite = bool(overwrite)
        self._spool = os.path.abspath(os.fspath(spool)) if spool is not None else None
        self._group = process_group
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self._staged: Deque[_Save] = collections.deque()
        self._current: Optional[_Save] = None
        self._lock = threading.Lock()
        #: The engines this writer stages through (shared by the process's writers).
        self._session = SESSION
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

    #: What a pickled writer leaves out: the state of this process (its lock, its staged
    #: saves, the session of its engines, the process group, the replica check and its
    #: groups, its last reports).
    _NOT_PICKLED = ("_lock", "_staged", "_current", "_session", "_group", "_check", "last_report", "last_stage")
    #: A writer received from another process whose ``check_replicas`` stayed behind: it
    #: refuses to stage a save itself (that save could not be checked).
    _check_left: bool = False

    def __getstate__(self) -> Dict[str, Any]:
        """The writer's configuration only (path, overwrite, spool, engine settings): no
        engine, descriptor, shared memory nor staged save. DCP's PROCESS checkpointer
        pickles the writer to its checkpoint process; the saves this writer staged travel
        with their state dicts (``StagedState``), and the process group stays behind (DCP
        saves on that process's default group), as does the replica check (it runs in
        this process when a staged save is handed over)."""
        state = {k: v for k, v in self.__dict__.items() if k not in self._NOT_PICKLED}
        state["_check_left"] = self._check is not None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._staged = collections.deque()
        self._current = None
        self._lock = threading.Lock()
        self._session = SESSION
        self._group = None
        self._check = None
        self.last_report = None
        self.last_stage = {}
        # A save this writer must stage itself (no staged state came with it) opens an
        # engine of this process, numbered apart from the sender's saves.
        self._role = "received"

    # -- StorageWriter ---------------------------------------------------------------------
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id:
            self.path = _dcp_remote.norm(checkpoint_id)
            self._path_from_reset = True
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if is_coordinator:
            _check_target(self.path, self._overwrite)

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
            staged = list(self._staged) + list(self._session.received)
        owners = next(
            (sv.owners for sv in staged if sv.owners is not None and set(sv.owners) == set(planned)),
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

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once staged."""

    def close(self) -> None:
        """Nothing to release per writer (the engine is shared; see ``release()``)."""

    # -- writing ---------------------------------------------------------------------------
    def _take_received(self, planned: Any) -> Optional[_Save]:
        """The save another process staged and handed over with the state dict DCP is now
        writing (``StagedState``), if any; older received saves (their upload failed
        before write_data) are dropped with their files."""
        received = list(self._session.received)
        save = next((sv for sv in reversed(received) if sv.matches(planned) or not sv.leaves), None)
        if save is None:
            return None
        for sv in self._session.take_received(save):
            if sv.error is None:
                for d in _sources(sv, sv.rank):
                    _remove_tree(d)
        return save

    def _take_staged(self, planned: Any) -> Optional[_Save]:
        """The staged save DCP is now writing. Saves staged before it whose upload failed
        before reaching write_data (DCP raised in planning) are dropped, with their files,
        so a reused writer never publishes an older snapshot under a newer name."""
        received = self._take_received(planned)
        if received is not None:
            return received
        with self._lock:
            staged = list(self._staged)
            pick = next((i for i, sv in enumerate(staged) if sv.matches(planned)), None)
            if pick is None:
                if staged:
                    raise SaveFailed(
                        "ShmckptWriter: DCP is saving tensors that stage() did not stage (a "
                        "planner that replaces them?); stage() supports DCP's default planning"
                    )
                stale, save = [], None
            else:
                for _ in range(pick + 1):
                    self._staged.popleft()
                stale, save = staged[:pick], staged[pick]
        for sv in stale:
            if self._check is not None and sv.handle is not None:
                sv.handle.confirm_commit("DCP abandoned the save before writing it")
            try:
                sv.handle.wait()
            except Exception:  # the error of a save DCP abandoned: its files are removed below
                pass
            for d in _sources(sv, sv.rank):
                _remove_tree(d)
        return save

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        save = self._take_staged(getattr(planner, "state_dict", None))
        if save is None:
            # dcp.save (no stage): resolve the planned items now and stage them.
            if self._check_left:
                raise SaveFailed(
                    "ShmckptWriter(check_replicas=...): with async_save's PROCESS checkpointer the "
                    "replica check runs in the trainer, so the stager must be the ShmckptWriter; "
                    "this save was not staged by it (use the THREAD checkpointer)"
                )
            _check_target(self.path, self._overwrite)
            save, rank, world = self._begin()
            objs = []
            for wi in plan.items:
                data: Any = planner.resolve_data(wi)
                if wi.type == WriteItemType.BYTE_IO:
                    data = data.getvalue()
                objs.append((wi.index, data))
            if self._check is not None:
                self._check.snapshot(save, local_unplanned(planner, plan))
            self._submit(save, rank, world, objs)
        self._current = save
        if save.handle is None:  # staged by another process, which waited for it
            if save.failure is not None:
                raise save.failure  # as the staging process raised it (ReplicaDivergence...)
            if save.error is not None or save.report is None:
                raise SaveFailed(f"ShmckptWriter: this rank's save (staged by the trainer's engine) failed: {save.error}")
            rank, world = _rank_world(self._group)
            if (rank, world) != (save.rank, save.world):
                raise SaveFailed(
                    f"ShmckptWriter: staged as rank {save.rank} of {save.world}, written as rank {rank} "
                    f"of {world}: async_save's PROCESS checkpointer saves on the default process group only"
                )
            report = save.report
        else:
            if self._check is not None:
                self._check.check(save)  # a collective of the group; raises on divergence
            report = save.handle.wait()  # this rank's file and manifest part are durable
            if _dcp_remote.is_remote(save.path):
                report = dict(report, remote=_dcp_remote.wait_committed(save.handle))
        self.last_report = report
        save.file = os.path.basename(report["file"])
        results = write_results(save, plan.items, "ShmckptWriter")
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
        _check_target(self.path, self._overwrite)
        # One rename makes the complete checkpoint appear at self.path.
        # With overwrite, a previous checkpoint there is swapped out atomically.
        _shmckpt.publish_dir(
            step_dir,
            [(METADATA_FILE, pickle.dumps(metadata))],
            self.path,
            METADATA_FILE if self._overwrite else None,
        )
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
