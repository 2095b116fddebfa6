"""Helpers shared by ``Checkpointer`` and the DCP writer and reader: capturing tensors for
the engine (host tuples, pinned copies of CUDA spans), pausing the cyclic GC around
per-tensor work, and opening a checkpoint's files without following links."""

from __future__ import annotations

import contextlib
import gc
import os
import stat
from typing import Any, List, Tuple

import numpy as np

from . import _state
from .errors import UnsafePath

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]


@contextlib.contextmanager
def _gc_paused() -> Any:
    """No cyclic garbage collection inside: flattening a large state allocates a few
    objects per tensor, all kept, which otherwise triggers repeated collections (of the
    whole heap, tensors included) costing more than the flattening itself."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _storage_key(t: Any) -> Tuple[Any, int]:
    """Identifies the memory a tensor (or a DTensor's local shard) lives in: its device
    (a ``torch.device``) and the address of its storage."""
    if _state._is_dtensor(t):
        t = t.to_local()
    return (t.device, t.untyped_storage().data_ptr())


def _host_tuple(name: str, st_dtype: str, t: Any) -> Tuple[str, str, List[int], int, int, int]:
    """The engine tuple of a contiguous CPU tensor or array (the caller keeps ``t``)."""
    if isinstance(t, np.ndarray):
        nbytes = int(t.nbytes)
        ptr = int(t.ctypes.data) if nbytes else 0
        return (name, st_dtype, list(t.shape), ptr, nbytes, -1)
    nbytes = t.numel() * t.element_size()
    ptr = int(t.data_ptr()) if nbytes else 0
    return (name, st_dtype, list(t.shape), ptr, nbytes, -1)


def _cuda_span_copy(t: Any) -> Tuple[Any, Any]:
    """Queue a copy of a CUDA tensor's bytes into pinned host memory on the current stream,
    allocating no device memory. Returns (pinned, finish): ``finish()`` (after the stream
    has reached the copy) gives the contiguous host tensor of ``t``'s values. A conjugate or
    negative view's memory is copied as it is and its bits are applied on the host."""
    if _state.is_lazy(t):
        raw, apply = _state.raw_view(t)
        pinned, finish = _cuda_span_copy(raw)
        return pinned, (lambda: apply(finish()))
    if t.is_contiguous():
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if t.numel():
            h.copy_(t, non_blocking=True)
        return h, (lambda: h)
    # Copy the whole storage span the view covers (contiguous, so no device temporary),
    # then gather on the host.
    base, gather = _span(t)
    h = torch.empty(base.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(base, non_blocking=True)
    return h, (lambda: gather(h))


def _span(t: Any) -> Tuple[Any, Any]:
    """A contiguous 1-D view of the storage range a (non-empty) strided tensor covers, and
    the function that rebuilds the tensor's logical contents from a copy of it."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    base = t.as_strided((span,), (1,), t.storage_offset())
    shape, stride = tuple(t.shape), tuple(t.stride())
    return base, (lambda copy: copy.as_strided(shape, stride, 0).contiguous())


def _open_untrusted(path: str) -> Any:
    """Open a file of a checkpoint for reading as the engine's reader does: no link
    followed, never blocked by a FIFO, regular files only (``UnsafePath`` otherwise)."""
    f = open(path, "rb", opener=lambda p, fl: os.open(p, fl | os.O_NOFOLLOW | os.O_NONBLOCK))
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise UnsafePath(f"{path}: not a regular file; refusing to read it", path=path)
    return f


def byte_view(x: Any) -> Any:
    """The memory of a C-contiguous destination ``x`` as a flat ``uint8`` array sharing it,
    for the engine's ``load_into*`` (which read the memory from the object's
    ``__array_interface__``, or ``__cuda_array_interface__`` on a CUDA device, and check it:
    writable, contiguous, the right length): a numpy array or CPU tensor gives a numpy
    view, a CUDA tensor a CUDA ``uint8`` tensor. Raises ``ValueError`` for a
    non-contiguous one."""
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError("a load destination must be C-contiguous")
        return x.reshape(-1).view(np.uint8)
    d = x.detach()
    if not d.is_contiguous():
        raise ValueError("a load destination must be contiguous")
    flat = d.reshape(-1).view(torch.uint8)
    return flat if flat.device.type == "cuda" else flat.numpy()
