"""``ShmckptWriter.stage``: a state dict's items handed to this rank's engine, which copies
them into its shared-memory arena."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from typing import Any, Deque, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from ..config import Tuning
from .. import _state
from .._util import _cuda_span_copy, _gc_paused, _host_tuple, engine_tuples
from ..errors import TooLarge
from .engines import SESSION, DcpSession, _rank_world
from .items import (
    _assign_owners,
    _check_target,
    _copy_containers,
    _entry_bound,
    _estimate_file,
    _item_bytes,
    _Item,
    _key,
    _offsets_of,
    _Save,
)
from .storage import _FORMAT_KEY, _HF_SHARDING_KEY, SPOOL_NAME
from . import bucket as _dcp_remote


class StagingMixin:
    """The staging half of :class:`~shmckpt.dcp.ShmckptWriter` (its attributes are set by
    the writer's constructor)."""

    path: str
    _overwrite: bool
    _spool: Optional[str]
    _group: Any
    _opts: Tuning
    _staged: Deque[_Save]
    _lock: threading.Lock
    last_stage: Dict[str, Any]
    _path_from_reset: bool
    _session: DcpSession
    #: ``"received"`` in a writer that came from another process (DCP's checkpoint
    #: process): its own saves number apart (``DcpSession.next_step``).
    _role: str = ""
    _check: Any  # shmckpt.dcp.divergence.DcpReplicaCheck with check_replicas, else None

    # -- staging ---------------------------------------------------------------------------
    def _begin(self) -> Tuple[_Save, int, int]:
        rank, world = _rank_world(self._group)
        if _dcp_remote.is_remote(self.path):
            # The bucket root is the engine's "spool"; the engine step is the path's N.
            spool, step = _dcp_remote.split(self.path)
            _dcp_remote.agree_session(spool, world, lambda: self._session.gather_group(self._group))
            save = _Save(spool, step, self.path)
            save.rank, save.world = rank, world
            return save, rank, world
        spool = self._spool or os.path.join(os.path.dirname(self.path), SPOOL_NAME)
        save = _Save(spool, self._session.next_step(spool, rank, world, self._role), self.path)
        save.rank, save.world = rank, world
        return save, rank, world

    def _submit(self, save: _Save, rank: int, world: int, objs: List[Tuple[MetadataIndex, Any]]) -> None:
        """Hand ``objs`` (tensors, or bytes of non-tensor items) to the engine and return
        once they are staged. One pass over the items builds the engine's tuples, the
        header's sharding entries and the file estimate (the caller's stall)."""
        names: Dict[str, MetadataIndex] = {}
        sharding: Dict[str, Any] = {}
        # Engine tuples (name, dtype, shape, memory, nbytes, device; the memory a tensor or
        # array, made a DLPack capsule at each call, None for no bytes; device -1 for host
        # memory) and, at the same index, what keeps each one's memory alive.
        tuples: List[Tuple[str, str, List[int], Any, int, int]] = []
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
                    tuples.append((name, st, shape, None, 0, -1))
                    keep.append(t)
                elif t.is_contiguous() and not lazy:
                    tuples.append((name, st, shape, t, nbytes, dev))
                    keep.append(t)
                else:
                    # A strided or lazy view: copy its storage span to pinned host memory
                    # (no device memory), then gather (and apply the bits) on the host.
                    with torch.cuda.device(dev):
                        pinned, fin = _cuda_span_copy(t)
                    tuples.append((name, st, shape, None, 0, -1))
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
        slot = self._session.engine(save.spool, rank, world, need, self._opts, self._role)
        if finishes:
            for s in streams.values():
                s.synchronize()  # those streams only, not the device
            for i, fin in finishes:
                h = fin()
                tuples[i] = _host_tuple(tuples[i][0], tuples[i][1], h)
                keep[i] = [keep[i], h]
        after = [(d, "stream", s) for d, s in streams.items()]
        # A local spool: the rank's part only, committed by the coordinator with every
        # other rank's (assemble_ranks). A bucket: the engine's remote tier commits it.
        part_only = not _dcp_remote.is_remote(save.spool)
        # check_replicas: the part is held until the replica check confirms it.
        confirm = self._check is not None
        try:
            h = slot.engine.save(save.step, engine_tuples(tuples), meta, after, True, part_only=part_only, confirm=confirm)
        except TooLarge:
            # The header estimate was short: reopen with twice the room and retry once.
            slot = self._session.engine(save.spool, rank, world, 2 * need + (16 << 20), self._opts, self._role)
            h = slot.engine.save(save.step, engine_tuples(tuples), meta, after, True, part_only=part_only, confirm=confirm)
        # save() returned: every byte is staged, `keep` (our references) may go.
        save.handle = h
        self.last_stage["engine"] = h.wait_staged()  # returns at once: staged already

    def stage(self, state_dict: Dict[str, Any], **kwargs: Any) -> Dict[str, Any]:
        """Copy every tensor of ``state_dict`` (local shards of DTensors) into the engine's
        shared-memory arena and start writing; return once staged. Non-tensor values are
        serialized now. Returns the state dict for DCP's planning (its tensors are not read
        again), a :class:`StagedState`, whose pickled form is what DCP's PROCESS
        checkpointer sends to its process."""
        t0 = time.perf_counter()
        self.last_stage = {}
        if not self._path_from_reset:
            _check_target(self.path, self._overwrite)  # early: before anything is staged
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
            dist.all_gather_object(gathered, mine, group=self._session.gather_group(self._group))
            save.owners = _assign_owners(gathered)
            if self._check is not None:
                # This rank's copies of what others write, checksummed while this is the
                # save's snapshot (check_replicas).
                self._check.snapshot(save, [(i, d) for i, d in objs if save.owners[_key(i)] != rank])
            objs = [(i, d) for i, d in objs if save.owners[_key(i)] == rank]
        t1 = time.perf_counter()
        self._submit(save, rank, world, objs)
        t2 = time.perf_counter()
        with self._lock:
            self._staged.append(save)
        out = StagedState(_copy_containers(state_dict), save, self)
        self.last_stage.update(items_s=t1 - t0, submit_s=t2 - t1, total_s=time.perf_counter() - t0)
        return out

    def _hand_off(self, save: _Save) -> None:
        """``save`` goes to another process with its state dict: run the replica check
        (``check_replicas``: the ranks of its group hand their saves over in the same
        order, and the engine holds the commit until it is decided), wait until this
        rank's file is durable (committed in the bucket, for an ``s3://`` checkpoint) and
        keep the report, or why it failed, on ``save``; this writer forgets it."""
        if save.handle is not None and save.report is None and save.error is None:
            try:
                if self._check is not None:
                    self._check.check(save)  # a collective of the group; raises on divergence
                report = save.handle.wait()
                if _dcp_remote.is_remote(save.path):
                    report = dict(report, remote=_dcp_remote.wait_committed(save.handle))
                save.report = _plain(report)
            except Exception as e:  # the receiver raises it from write_data, on every rank
                save.error = f"{type(e).__name__}: {e}"
                save.failure = _portable(e)
        with self._lock:
            if save in self._staged:
                self._staged.remove(save)


def _portable(e: BaseException) -> Optional[BaseException]:
    """``e`` when it is one of shmckpt's errors and survives pickling (to be raised by the
    process the save is handed to), else None."""
    import pickle

    from ..errors import ShmckptError

    if not isinstance(e, ShmckptError):
        return None
    try:
        back = pickle.loads(pickle.dumps(e))
    except Exception:
        return None
    return back if type(back) is type(e) else None


def _plain(x: Any) -> Any:
    """``x`` (an engine report) as plain dicts, lists and scalars."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


class _Unread:
    """A non-tensor value of a state dict handed to DCP's checkpoint process: already
    serialized into the rank's file by ``stage()``, so only its place is sent."""

    def __repr__(self) -> str:
        return "<staged by ShmckptWriter>"

    def __reduce__(self) -> Any:
        return (_unread, ())


UNREAD = _Unread()


def _unread() -> _Unread:
    return UNREAD


class StagedState(Dict[str, Any]):
    """What :meth:`ShmckptWriter.stage` returns: new containers around the state dict's
    own leaves (DCP plans the save from it; its tensors are not read again).

    Pickled, which is how DCP's PROCESS checkpointer (``async_save(...,
    async_checkpointer_type=AsyncCheckpointerType.PROCESS)``) sends it to its checkpoint
    process, it becomes its *plan view*: the same containers, every tensor replaced by a
    ``meta`` tensor of its shape, strides and dtype (a DTensor by a DTensor of the same
    mesh and placements over a ``meta`` local tensor) and every other value by a
    placeholder, plus the description of the save (``_Save``: names, sizes, owners, and
    the engine's report). No tensor's storage is pickled: torch's ``ForkingPickler``
    would move a CPU tensor's storage into shared memory and send a CUDA tensor as an IPC
    handle. Pickling waits until this rank's file is durable (DCP pickles in its executor
    thread, after ``async_save`` returned); the receiving process's writer takes the
    description in ``write_data`` and never opens an engine for it."""

    def __init__(self, items: Dict[str, Any], save: _Save, writer: "StagingMixin"):
        super().__init__(items)
        self._save = save
        self._writer = writer

    def __copy__(self) -> Dict[str, Any]:
        return dict(self)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Dict[str, Any]:
        import copy

        return copy.deepcopy(dict(self), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        problems: List[str] = []
        view = _plan_view(dict(self), problems, "")
        save = self._save
        self._writer._hand_off(save)
        if problems and save.error is None:
            save.error = (
                "ShmckptWriter with async_save's PROCESS checkpointer cannot plan "
                + ", ".join(problems[:5])
                + " in the checkpoint process; use the THREAD checkpointer"
            )
        return (_receive, (view, save))


class _TensorSpec(NamedTuple):
    """A tensor of the plan view, as sent: a ``meta`` tensor is rebuilt from it on
    arrival (pickling meta tensors through torch's reductions costs ~0.1 ms each)."""

    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def build(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
        return t.requires_grad_(True) if self.requires_grad else t


class _DTensorSpec(NamedTuple):
    """A DTensor of the plan view, as sent: its local tensor's spec, its mesh and
    placements, its global shape and strides."""

    local: _TensorSpec
    mesh: Any
    placements: Tuple[Any, ...]
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    requires_grad: bool

    def build(self) -> Any:
        from torch.distributed.tensor import DTensor

        d = DTensor.from_local(
            self.local.build(), self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape), stride=self.stride
        )
        return d.requires_grad_(True) if self.requires_grad else d


def _spec(t: torch.Tensor) -> _TensorSpec:
    return _TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype, bool(t.requires_grad))


def _plan_view(x: Any, problems: List[str], at: str) -> Any:
    """The plan view of ``x`` as sent (see :class:`StagedState`): the same containers,
    every tensor replaced by its spec (``_receive`` makes the ``meta`` tensors) and every
    other leaf by ``UNREAD``; what cannot be planned elsewhere is named in ``problems``."""
    from collections.abc import Mapping

    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(x, Mapping):
        return {k: _plan_view(v, problems, f"{at}.{k}" if at else str(k)) for k, v in x.items()}
    if isinstance(x, list):
        return [_plan_view(v, problems, f"{at}.{i}") for i, v in enumerate(x)]
    if isinstance(x, ShardedTensor):
        problems.append(f"{at!r} (a ShardedTensor)")
        return UNREAD
    if isinstance(x, DTensor):
        return _DTensorSpec(
            _spec(x.to_local()), x.device_mesh, tuple(x.placements), tuple(x.shape), tuple(x.stride()), x.requires_grad
        )
    if isinstance(x, torch.Tensor):
        return _spec(x)
    return UNREAD


def _built(x: Any) -> Any:
    """The plan view sent by ``_plan_view`` with its tensors made (``meta``)."""
    if isinstance(x, dict):
        return {k: _built(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_built(v) for v in x]
    if isinstance(x, (_TensorSpec, _DTensorSpec)):
        return x.build()
    return x


def _receive(view: Dict[str, Any], save: _Save) -> Dict[str, Any]:
    """Unpickling a :class:`StagedState` in the checkpoint process: keep ``save`` in this
    process's session, its leaves being the plan view's tensors (the objects DCP's planner
    will hold), and give DCP the plan view."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    view = _built(view)
    flat, _ = flatten_state_dict(view)
    save.leaves = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    SESSION.receive(save)
    return view
