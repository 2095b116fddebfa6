"""Megatron-Core ``dist_checkpointing`` through shmckpt.

Megatron's ``--async-save`` path (``dist_checkpointing.save(..., async_sharded_save=True)``
returning an ``AsyncRequest`` that Megatron's ``AsyncCallsQueue`` schedules and
finalizes) drives shmckpt instead of NVRx's ``FileSystemWriterAsync``::

    import shmckpt.megatron
    from megatron.core import dist_checkpointing

    strategy = shmckpt.megatron.ShmckptSaveShardedStrategy()
    req = dist_checkpointing.save(sharded_sd, ckpt_dir, strategy, async_sharded_save=True)
    queue.schedule_async_request(req)          # Megatron's AsyncCallsQueue
    ...                                        # train on: the state is already staged
    queue.maybe_finalize_async_calls()         # commits once every rank's file is durable

    dist_checkpointing.load(sharded_sd, ckpt_dir,   # any parallel layout (resharding)
                            sharded_strategy=shmckpt.megatron.ShmckptLoadShardedStrategy())

Supported: megatron-core 0.16.x and 0.19.x (:data:`SUPPORTED_MEGATRON`); importing this
module with another release installed raises ``ImportError`` naming it.

``ShmckptSaveShardedStrategy.async_save`` translates Megatron's ``ShardedTensor`` and
``ShardedObject`` values into PyTorch DCP objects and plans them exactly as Megatron's
``TorchDistSaveShardedStrategy`` does (``MCoreSavePlanner``), then hands this rank's
planned items to shmckpt's engine (:class:`shmckpt.dcp.ShmckptWriter`'s staging): CUDA
tensors are copied straight into the engine's registered shared-memory arena on the
engine's own stream (no CUDA IPC handle, no device memory allocated, no
``empty_cache``); the call returns once every byte is staged, and the engine's writers
make the rank file durable in the background. The returned ``AsyncRequest``'s
``async_fn`` only *waits* for that (whichever process Megatron runs it in: a forked
``TemporalAsyncCaller`` child, the persistent worker, or in-process for a synchronous
save), and its finalize function commits with shmckpt's protocol: the coordinator
assembles the rank files and ``manifest.json``, then DCP's ``.metadata``, into the
checkpoint directory; Megatron's own finalize function then writes ``metadata.json``
(backend ``shmckpt_dist``), which makes the directory a Megatron checkpoint.

With megatron-core 0.16, importing this module registers the strategies as Megatron's
defaults for the ``shmckpt_dist`` backend, so ``dist_checkpointing.load`` (and
Megatron-LM's ``load_checkpoint``) find :class:`ShmckptLoadShardedStrategy` from the
checkpoint's ``metadata.json``; 0.19 has no such registry, and its ``load`` needs
``sharded_strategy=ShmckptLoadShardedStrategy()``. On 0.19 the common state, which
Megatron hands to the strategy, is published as ``common.pt`` with the commit (0.19's
``load`` reads it from there). See docs/megatron.md.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import stat
import threading
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _get_failure_dict, _wrap_exception

#: megatron-core releases this module supports, by (major, minor): their
#: ``dist_checkpointing`` layouts differ (0.16: ``strategies.base`` with a registry of
#: default strategies, ``common.pt`` written by ``save``; 0.19: no registry, the common
#: state handed to the strategy as a ``ShardedObject``, NVRx's async queue the default).
SUPPORTED_MEGATRON = ("0.16", "0.19")


def _megatron_version() -> Tuple[str, Tuple[int, int]]:
    """The installed megatron-core's version string and its (major, minor); raises a
    clear ImportError when it is missing or not a supported release."""
    import re

    try:
        from megatron.core import package_info
    except ImportError as e:
        raise ImportError(
            f"shmckpt.megatron needs megatron-core {' or '.join(v + '.x' for v in SUPPORTED_MEGATRON)} "
            f"(pip install megatron-core): {e}"
        ) from e
    version = str(getattr(package_info, "__version__", "unknown"))
    m = re.match(r"(\d+)\.(\d+)", version)
    mm = (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
    if f"{mm[0]}.{mm[1]}" not in SUPPORTED_MEGATRON:
        raise ImportError(
            f"shmckpt.megatron supports megatron-core {' and '.join(v + '.x' for v in SUPPORTED_MEGATRON)}; "
            f"megatron-core {version} is installed ({os.path.dirname(package_info.__file__)})"
        )
    return version, mm


MEGATRON_VERSION, _MEGATRON_MM = _megatron_version()
#: True for megatron-core 0.19's layout (no strategy registry; common state in the save).
_NEW_LAYOUT = _MEGATRON_MM >= (0, 19)

try:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedStateDict,
        ShardedTensor,
        StateDict,
        is_main_replica,
    )
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        MCoreSavePlanner,
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict,
    )

    if _NEW_LAYOUT:
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy
    else:
        from megatron.core.dist_checkpointing.strategies.base import StrategyAction, register_default_strategy
except ImportError as e:  # pragma: no cover - a supported version that lacks a name
    raise ImportError(
        f"shmckpt.megatron: megatron-core {MEGATRON_VERSION} lacks a name this module uses "
        f"(supported: {', '.join(v + '.x' for v in SUPPORTED_MEGATRON)}): {e}"
    ) from e

from . import _shmckpt
from ._util import _gc_paused
from .config import Tuning, tuning_of
from .dcp import ShmckptReader, ShmckptWriter
from .dcp.writer import write_results
from .dcp.engines import _remove_tree, _sources
from .dcp.storage import METADATA_FILE
from .errors import SaveFailed

__all__ = [
    "BACKEND",
    "VERSION",
    "MEGATRON_VERSION",
    "SUPPORTED_MEGATRON",
    "ShmckptSaveShardedStrategy",
    "ShmckptLoadShardedStrategy",
    "register",
]

logger = logging.getLogger(__name__)

#: The backend name written into a checkpoint's ``metadata.json``.
BACKEND = "shmckpt_dist"
#: The format version written with it.
VERSION = 1
#: Where megatron-core 0.19 looks for the common (non-sharded) state before it tries to
#: read it through DCP's ``FileSystemReader`` (which cannot read shmckpt's files).
COMMON_FILE = "common.pt"


def _wait_durable(reader: Connection, writer_fd: int, pipe_id: Tuple[int, int], owner_pid: int) -> None:
    """``AsyncRequest.async_fn``: return once this rank's file is durable, raise if its
    save failed. Megatron runs it in a forked child (``TemporalAsyncCaller``), in its
    persistent worker (the request pickled; ``reader`` travels as a duplicated
    descriptor), or in the trainer for a synchronous save; in each, Megatron's "is the
    async call alive" is then exactly "is this rank's file not yet durable". The bytes
    were staged before the request was made; nothing here touches them.

    In a forked child, the inherited copy of the pipe's write end is closed first (it is
    ``writer_fd`` only if it is still the same pipe, ``pipe_id``), so a trainer that dies
    makes this return with an error instead of waiting forever."""
    if os.getpid() != owner_pid:
        try:
            st = os.fstat(writer_fd)
            if stat.S_ISFIFO(st.st_mode) and (st.st_dev, st.st_ino) == pipe_id:
                os.close(writer_fd)
        except OSError:
            pass  # not inherited (the persistent worker): nothing to close
    try:
        status = reader.recv_bytes()
    except EOFError:
        raise SaveFailed("shmckpt.megatron: the trainer went away before this rank's file was durable") from None
    finally:
        reader.close()
    if status != b"ok":
        raise SaveFailed(f"shmckpt.megatron: this rank's save failed: {status.decode(errors='replace')}")


class _MegatronWriter(ShmckptWriter):
    """:class:`~shmckpt.dcp.ShmckptWriter` on Megatron's asynchronous DCP contract
    (``prepare_write_data``, ``get_save_function_and_args``, ``retrieve_write_results``,
    ``finish``), the one NVRx's ``FileSystemWriterAsync`` implements.

    Megatron's checkpoint directory exists already and holds its ``common.pt`` (written
    by rank 0 before the sharded save), so ``finish`` moves this save's files into it
    instead of publishing a new directory with one rename."""

    def __init__(self, path: Union[str, os.PathLike], **opts: Any):
        super().__init__(path, **opts)
        self._plan: Optional[SavePlan] = None
        self._watcher: Optional[threading.Thread] = None
        self._report: Optional[Dict[str, Any]] = None
        self._error: Optional[BaseException] = None
        self._reader: Optional[Connection] = None
        self._pipe: Optional[Tuple[int, Tuple[int, int]]] = None
        #: megatron-core 0.19: the common state's ``torch.save`` bytes (on the rank that
        #: holds its main replica), published as ``common.pt`` with the commit.
        self.common: Optional[bytes] = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # Megatron owns the directory (on 0.16 its common.pt is in it already): no
        # emptiness check.
        self.is_coordinator = is_coordinator

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Stage this rank's planned items into the engine's shared-memory arena and
        start writing; return once every byte is staged (the trainer may then change its
        tensors)."""
        save, rank, world = self._begin()
        objs: List[Tuple[MetadataIndex, Any]] = []
        for wi in plan.items:
            data: Any = planner.resolve_data(wi)
            if wi.type == WriteItemType.BYTE_IO:
                data = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            objs.append((wi.index, data))
        with _gc_paused():
            self._submit(save, rank, world, objs)
        self._current = save
        self._plan = plan
        reader, writer = Pipe(duplex=False)
        st = os.fstat(writer.fileno())
        self._reader = reader
        self._pipe = (writer.fileno(), (st.st_dev, st.st_ino))
        self._watcher = threading.Thread(
            target=self._watch, args=(save.handle, writer), name="shmckpt-megatron-durable", daemon=True
        )
        self._watcher.start()

    def _watch(self, handle: Any, writer: Connection) -> None:
        """Wait (GIL released) until this rank's file is durable; tell the async_fn."""
        status = b"ok"
        try:
            self._report = handle.wait()
        except Exception as e:  # kept, re-raised by retrieve_write_results
            self._error = e
            status = f"{type(e).__name__}: {e}".encode()
        finally:
            try:
                writer.send_bytes(status)
            except OSError:
                pass  # the reader is gone (the async_fn died): finalize reports the error
            writer.close()

    def get_save_function_and_args(self) -> Tuple[Any, None, List[Any]]:
        """Megatron's ``(async_fn, preload_fn, args)``: the async function waits for this
        rank's file to be durable; there is nothing to preload (staged already)."""
        if self._reader is None or self._pipe is None:
            raise SaveFailed("get_save_function_and_args called before prepare_write_data")
        return _wait_durable, None, [self._reader, self._pipe[0], self._pipe[1], os.getpid()]

    def retrieve_write_results(self) -> List[WriteResult]:
        """This rank's ``WriteResult``s, once its file is durable (raises what the engine
        raised if the save failed)."""
        save = self._current
        if save is None or self._watcher is None or self._plan is None:
            raise SaveFailed("retrieve_write_results called before prepare_write_data")
        self._watcher.join()
        if self._reader is not None:
            self._reader.close()  # the in-process copy (async_fn ran elsewhere)
        if self._error is not None:
            raise self._error
        report = self._report
        assert report is not None
        self.last_report = report
        save.file = os.path.basename(report["file"])
        return write_results(save, self._plan.items, type(self).__name__)

    def discard(self) -> None:
        """After a failed save: remove what this rank left of it in the spool (its file,
        and on the coordinator an assembled directory), so a long run does not keep the
        files of failed saves until its next start."""
        save = self._current
        if save is None:
            return
        self._current = None
        for d in _sources(save, save.rank):
            _remove_tree(d)
        if os.path.isdir(save.step_dir) and not os.path.islink(save.step_dir):
            _remove_tree(save.step_dir)

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Commit (coordinator): gather every rank's durable file and ``manifest.json``
        in the spool, write DCP's ``.metadata`` next to them, then move the rank files,
        ``manifest.json`` and, last, ``.metadata`` into the checkpoint directory (each a
        ``rename``), ``fsync`` it, and remove rank files of an earlier attempt at the same
        directory. Megatron's ``metadata.json``, written after this by its own finalize
        function, is what makes the directory a checkpoint to Megatron."""
        save = self._current
        if save is None:
            raise SaveFailed("finish called before prepare_write_data")
        # The commit protocol in Rust: every rank's part checked, the files moved into
        # spool/step-N, manifest.json written (shmckpt::commit::assemble_ranks).
        step_dir, sources = self._assemble(save, metadata, results)
        target = self.path
        if os.path.islink(target) or not os.path.isdir(target):
            raise FileNotFoundError(f"{target}: Megatron's checkpoint directory is missing (or a symbolic link)")
        # Into Megatron's existing directory (0.16: it holds common.pt already): rank files
        # and manifest.json, then (0.19) common.pt, then .metadata last; stale rank files
        # of an earlier attempt go (shmckpt::commit::publish_into).
        files: List[Tuple[str, bytes]] = []
        if self.common is not None:
            files.append((COMMON_FILE, self.common))
        files.append((METADATA_FILE, pickle.dumps(metadata)))
        _shmckpt.publish_into(step_dir, files, target)
        self._current = None
        for d in sources:  # the ranks' emptied partial directories
            _remove_tree(d)


def _finalize(writer: _MegatronWriter, global_metadata: Optional[Metadata], dist_wrapper: Any) -> None:
    """The request's finalize function (every rank, after every rank's ``async_fn``
    returned): gather the write results, commit on the coordinator, and raise a
    ``CheckpointException`` on every rank if any rank (or the commit) failed. Megatron's
    ``save_state_dict_async_finalize`` with two differences: every rank raises with the
    failures of every rank (and of the commit), not only the coordinator; and nothing
    is placed on a CUDA device by hand (a gloo group needs no GPU)."""
    try:
        local: Any = writer.retrieve_write_results()
    except Exception as e:
        local = _wrap_exception(e)
    all_results = dist_wrapper.gather_object(local)
    failures: Dict[int, Any] = {}
    if dist_wrapper.is_coordinator:
        failures = _get_failure_dict(all_results)
        if not failures:
            try:
                if global_metadata is None:
                    raise SaveFailed("shmckpt.megatron: the coordinator has no global metadata")
                writer.finish(global_metadata, all_results)
            except Exception as e:
                failures = {dist_wrapper.coordinator_rank: _wrap_exception(e)}
    # Every rank learns the failures (they came through gather_object: they pickle).
    box = [failures]
    dist.broadcast_object_list(box, src=dist_wrapper.coordinator_rank, group=dist_wrapper.group)
    if box[0]:
        writer.discard()
        raise CheckpointException("write", box[0])


class ShmckptSaveShardedStrategy(TorchDistSaveShardedStrategy):
    """Megatron-Core async save strategy writing through shmckpt.

    A drop-in for Megatron's ``TorchDistSaveShardedStrategy``: the same translation of
    ``ShardedTensor`` / ``ShardedObject`` values into DCP objects and the same planning
    (``MCoreSavePlanner``; ``keep_only_main_replica``: write each shard from its main
    replica only, as Megatron does by default), then shmckpt's staging and commit (see
    the module's docstring). ``async_save`` returns once this rank's items are staged in
    pinned shared memory, with an ``AsyncRequest`` for Megatron's ``AsyncCallsQueue``;
    ``save`` (Megatron's synchronous path) runs the same request in place.

    ``spool``: where the engines write before the commit (default
    ``dirname(checkpoint_dir)/.shmckpt-dcp``, which must be on the checkpoint's
    filesystem). ``tuning``: the engine settings (a :class:`shmckpt.Tuning`), as for
    :class:`shmckpt.dcp.ShmckptWriter` (``staging_capacity`` sets a minimum; the arena
    is sized to the rank's file and reused by every later save in this process); the
    flat tuning keywords of earlier versions are accepted, deprecated.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        keep_only_main_replica: bool = True,
        *,
        spool: Optional[Union[str, os.PathLike]] = None,
        tuning: Optional[Tuning] = None,
        **legacy: Any,
    ):
        super().__init__(backend, version, keep_only_main_replica=keep_only_main_replica)
        self.spool = spool
        #: The engine settings of its writers (:class:`shmckpt.Tuning`).
        self.tuning = tuning_of(
            "ShmckptSaveShardedStrategy",
            tuning,
            legacy,
            ("backend", "version", "keep_only_main_replica", "spool", "tuning"),
        )
        #: The writer of the last ``async_save`` (its ``last_stage`` says where staging
        #: spent its time, ``last_report`` is the engine's report once durable).
        self.last_writer: Optional[_MegatronWriter] = None

    def async_save(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: Union[str, Path],
        async_strategy: Optional[str] = None,
    ) -> Any:
        """Plan as Megatron's ``torch_dist`` strategy does, stage this rank's items into
        shared memory, and return the ``AsyncRequest`` (wait for durability, then commit
        in its finalize function).

        ``async_strategy`` (megatron-core 0.19's ``dist_checkpointing.save`` passes it):
        ``"nvrx"`` (0.19's default) returns NVRx's ``AsyncRequest``, for NVRx's
        ``AsyncCallsQueue``, where nvidia-resiliency-ext is installed (Megatron's own
        otherwise: without NVRx there is no NVRx queue to schedule it); ``"mcore"``
        returns Megatron's, for ``megatron.core``'s queue. Nothing of NVRx's writer is
        used either way. On 0.19, the common state Megatron passes as the
        ``ShardedObject`` ``common_state`` is not staged with the tensors: its
        ``torch.save`` bytes are published as ``common.pt`` with the commit, where 0.19's
        ``dist_checkpointing.load`` reads it."""
        request_class = _request_class(async_strategy)  # before anything is staged
        common: Optional[bytes] = None
        if _NEW_LAYOUT:
            obj = sharded_state_dict.get("common_state") if isinstance(sharded_state_dict, dict) else None
            if isinstance(obj, ShardedObject) and obj.key == "common_state":
                sharded_state_dict = {k: v for k, v in sharded_state_dict.items() if k != "common_state"}
                if is_main_replica(obj.replica_id):
                    if dist.is_initialized() and dist.get_rank() != 0:
                        raise SaveFailed(
                            "shmckpt.megatron: the common state's main replica is on rank "
                            f"{dist.get_rank()}, not on the coordinator (rank 0)"
                        )
                    buf = io.BytesIO()
                    torch.save(obj.data, buf)
                    common = buf.getvalue()
        sharded_state_dict, _flat, _rename = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
        writer = _MegatronWriter(checkpoint_dir, spool=self.spool, tuning=self.tuning)
        writer.common = common
        # Megatron's planning (local plans gathered on the coordinator, which makes the
        # global metadata), then writer.prepare_write_data: shmckpt's staging.
        ret = save_state_dict_async_plan(
            pyt_state_dict,
            writer,
            None,
            0,
            planner=MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica,
                flatten_state_dict=False,
                can_run_decentralized_global_plan=False,
            ),
        )
        self.last_writer = writer
        storage_writer, global_metadata, dist_wrapper = ret[0]
        async_fn, preload_fn, args = writer.get_save_function_and_args()

        def finalize_fn() -> None:
            _finalize(storage_writer, global_metadata, dist_wrapper)

        return request_class(
            async_fn, tuple(args), [finalize_fn], async_fn_kwargs={}, preload_fn=preload_fn
        )


def _request_class(async_strategy: Optional[str]) -> Any:
    """The ``AsyncRequest`` class of the queue ``async_strategy`` names: NVRx's for
    ``"nvrx"`` on megatron-core 0.19 where NVRx is installed, Megatron's otherwise (its
    persistent worker takes only its own class: ``isinstance`` on each request)."""
    if _NEW_LAYOUT and async_strategy == "nvrx":
        try:
            return get_async_strategy("nvrx", module="AsyncRequest")[1]
        except ModuleNotFoundError:
            logger.debug("nvidia-resiliency-ext is not installed: Megatron's AsyncRequest")
    elif async_strategy not in (None, "nvrx", "mcore"):
        raise TypeError(f"async_strategy {async_strategy!r} is not supported (nvrx or mcore)")
    return AsyncRequest


class ShmckptLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Megatron-Core load strategy for checkpoints of :class:`ShmckptSaveShardedStrategy`.

    Megatron's ``TorchDistLoadShardedStrategy`` with :class:`shmckpt.dcp.ShmckptReader`
    as DCP's storage reader: every CRC-32C verified, DCP's resharding (a checkpoint
    saved with one tensor/pipeline parallel layout loads into another), whole shards
    read straight into their destinations. Registered as the default for the
    ``shmckpt_dist`` backend when this module is imported."""

    def __init__(self, *, direct_io: bool = True):
        super().__init__()
        self.direct_io = direct_io

    def _reader(self, checkpoint_dir: Union[str, Path]) -> ShmckptReader:
        return ShmckptReader(checkpoint_dir, direct_io=self.direct_io)

    def load(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: Union[str, Path],
        async_strategy: Optional[str] = None,
    ) -> StateDict:
        """Load ``sharded_state_dict``'s shards from ``checkpoint_dir`` (Megatron's
        ``TorchDistLoadShardedStrategy.load`` with shmckpt's reader; ``async_strategy``,
        which megatron-core 0.19 passes, only picks Megatron's reader there: unused)."""
        flexible = [
            t
            for t in nested_values(sharded_state_dict)
            if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch
        ]
        mismatch = {
            t.key: t
            for t in nested_values(sharded_state_dict)
            if isinstance(t, ShardedTensor) and t.allow_shape_mismatch
        }
        orig = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = self._reader(checkpoint_dir)
        torch.distributed.checkpoint.load_state_dict(
            pyt_state_dict,
            reader,
            planner=MCoreLoadPlanner(
                shapes_validation_sharded_tensors=flexible,
                allow_shape_mismatch_sharded_tensors=mismatch,
            ),
        )
        self.cached_global_metadata = reader._md
        mcore_state_dict = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        mcore_state_dict = _replace_sharded_keys_with_state_dict_keys(mcore_state_dict, flat_mapping, rename_mapping)
        _restore_dict_types(mcore_state_dict, orig)
        return mcore_state_dict

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path], metadata: Optional[Metadata] = None) -> Any:
        """Shapes and dtypes of the checkpoint's tensors (``.metadata`` read with
        shmckpt's restricted unpickler)."""
        if metadata is None:
            metadata = self._reader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Tensors' and objects' metadata (``.metadata`` read with shmckpt's reader)."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        metadata = self._reader(checkpoint_dir).read_metadata()
        out: Dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(super().load_tensors_metadata(checkpoint_dir, metadata))
        return out

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        """Not supported: a shmckpt checkpoint is immutable once committed."""
        raise NotImplementedError("shmckpt checkpoints are immutable: remove_sharded_tensors is not supported")


def register() -> bool:
    """Register :class:`ShmckptSaveShardedStrategy` and :class:`ShmckptLoadShardedStrategy`
    as Megatron's default strategies for backend ``shmckpt_dist``, version 1 (done when
    this module is imported). Returns whether it did: megatron-core 0.19 has no registry
    (its ``dist_checkpointing.load`` uses the ``sharded_strategy`` it is given, else
    ``TorchDistLoadShardedStrategy``), so there pass ``ShmckptLoadShardedStrategy()``."""
    if _NEW_LAYOUT:
        return False
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, ShmckptSaveShardedStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, ShmckptLoadShardedStrategy())
    return True


register()
