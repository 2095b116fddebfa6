"""``ShmckptWriter.stage``: a state dict's items handed to this rank's engine, which copies
them into its shared-memory arena."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from .. import _state
from .._util import _cuda_span_copy, _gc_paused, _host_tuple
from ..errors import TooLarge
from .engines import DcpSession, _rank_world
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
    _opts: Dict[str, Any]
    _staged: Deque[_Save]
    _lock: threading.Lock
    last_stage: Dict[str, Any]
    _path_from_reset: bool
    _session: DcpSession
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
        key = (spool, rank, world)
        save = _Save(spool, self._session.next_step(*key), self.path)
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
        slot = self._session.engine(save.spool, rank, world, need, self._opts)
        if finishes:
            for s in streams.values():
                s.synchronize()  # those streams only, not the device
            for i, fin in finishes:
                h = fin()
                tuples[i] = _host_tuple(tuples[i][0], tuples[i][1], h)
                keep[i] = [keep[i], h]
        after = [(d, "stream", s.cuda_stream) for d, s in streams.items()]
        # A local spool: the rank's part only, committed by the coordinator with every
        # other rank's (assemble_ranks). A bucket: the engine's remote tier commits it.
        part_only = not _dcp_remote.is_remote(save.spool)
        # check_replicas: the part is held until the replica check confirms it.
        confirm = self._check is not None
        try:
            h = slot.engine.save(save.step, tuples, meta, after, True, part_only=part_only, confirm=confirm)
        except TooLarge:
            # The header estimate was short: reopen with twice the room and retry once.
            slot = self._session.engine(save.spool, rank, world, 2 * need + (16 << 20), self._opts)
            h = slot.engine.save(save.step, tuples, meta, after, True, part_only=part_only, confirm=confirm)
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
        out = _copy_containers(state_dict)
        self.last_stage.update(items_s=t1 - t0, submit_s=t2 - t1, total_s=time.perf_counter() - t0)
        return out
