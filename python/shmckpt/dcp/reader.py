"""``ShmckptReader``: DCP's ``StorageReader`` for checkpoints written by ``ShmckptWriter``."""

from __future__ import annotations

import io
import os
import uuid
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import _shmckpt, _state
from .._util import _open_untrusted
from ..errors import CorruptError
from .metadata import load_metadata
from .storage import _FILE_RE, MANIFEST_FILE, METADATA_FILE, ShmckptStorageInfo
from . import bucket as _dcp_remote
from . import ranged as _ranged
from .metadata import MAX_METADATA_BYTES


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
        sm = getattr(md, "storage_meta", None)
        if sm is None:
            sm = md.storage_meta = StorageMeta()
        sm.load_id = self.load_id
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
            device: List[Tuple[str, torch.Tensor, int]] = []
            host: List[Tuple[str, torch.Tensor]] = []
            for k, req in enumerate(reqs):
                if req.type == LoadItemType.BYTE_IO:
                    continue
                target = planner.resolve_tensor(req).detach()
                targets[k] = target
                tname = self.storage_data[req.storage_index].tensor
                if tname not in direct and self._direct(req, target):
                    direct[tname] = (req, target)
                    if target.is_cuda:
                        device.append((tname, target, target.device.index))
                    else:
                        host.append((tname, target))
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
