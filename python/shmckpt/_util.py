"""Helpers shared by ``Checkpointer`` and the DCP writer and reader: capturing tensors for
the engine (host tuples, pinned copies of CUDA spans), pausing the cyclic GC around
per-tensor work, and opening a checkpoint's files without following links."""

from __future__ import annotations

import contextlib
import gc
import os
import stat
import threading
from typing import Any, Callable, List, Sequence, Tuple, TypeVar

import numpy as np

from . import _state
from .errors import UnsafePath

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]

_T = TypeVar("_T")


#: Threads inside :func:`_gc_paused`, and whether the first of them disabled the GC (it
#: was enabled): the last one out enables it again.
_pause_lock = threading.RLock()  # a signal handler that saves may enter on the same thread
_pauses = 0
_reenable = False


@contextlib.contextmanager
def _gc_paused() -> Any:
    """No cyclic garbage collection inside: flattening a large state allocates a few
    objects per tensor, all kept, which otherwise triggers repeated collections (of the
    whole heap, tensors included) costing more than the flattening itself. The pause is
    the process's (the GC is): several threads may be inside at once (the trainer's check
    and the submitting thread's start of the next save), and collections resume when the
    last one leaves, not when the first does, while the others' objects are still alive.
    A GC the caller disabled stays disabled."""
    global _pauses, _reenable
    with _pause_lock:
        if _pauses == 0:
            _reenable = gc.isenabled()
            if _reenable:
                gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _reenable:
                gc.enable()


def _gc_paused_call(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with the cyclic GC paused, as :func:`_gc_paused`, but resumed only
    once ``fn``'s frame is gone: the objects it made and dropped are freed by then. Resumed
    inside a ``with`` block instead, the collection that the pause had put off runs at
    once, while every temporary of the block is still referenced, and promotes them all
    towards the oldest generation; a save every step that way (~3,000 objects of a
    1,168-tensor capture) made CPython's full collection of the trainer's whole heap run
    every ~20 saves (369 ms each for 338,000 objects on a 2-core VM), on the thread
    holding the interpreter lock."""
    with _gc_paused():
        return fn(*args)


def _storage_key(t: Any) -> Tuple[Any, int]:
    """Identifies the memory a tensor (or a DTensor's local shard) lives in: its device
    (a ``torch.device``) and the address of its storage."""
    if _state._is_dtensor(t):
        t = t.to_local()
    return (t.device, t.untyped_storage().data_ptr())


def _host_tuple(name: str, st_dtype: str, t: Any) -> Tuple[str, str, List[int], Any, int, int]:
    """The engine tuple of a contiguous CPU tensor or array: ``t`` itself as the memory
    (``None`` for no bytes; :func:`engine_tuples` makes it a DLPack capsule at the call)."""
    if isinstance(t, np.ndarray):
        nbytes = int(t.nbytes)
        return (name, st_dtype, list(t.shape), t if nbytes else None, nbytes, -1)
    nbytes = t.numel() * t.element_size()
    return (name, st_dtype, list(t.shape), t if nbytes else None, nbytes, -1)


#: ``torch.utils.dlpack.to_dlpack``: a DLPack capsule of a tensor (no stream ordering: the
#: engine orders its device copies itself, after the streams and events it is given).
_to_dlpack: Any = torch.utils.dlpack.to_dlpack if torch is not None else None


def _array_capsule(a: Any) -> Any:
    """A DLPack capsule of the bytes of C-contiguous array ``a`` (a flat ``uint8`` view, so
    that every dtype exports): DLPack 1.x (read-only marked as such) where numpy has it; a
    read-only array on an older numpy is copied (only read)."""
    b = a.reshape(-1).view(np.uint8)
    try:
        return b.__dlpack__(max_version=(1, 0))
    except TypeError:  # numpy < 2.1: DLPack 0.x, which cannot say read-only
        return (b if b.flags.writeable else b.copy()).__dlpack__()


def capsule(x: Any) -> Any:
    """A DLPack capsule of the memory of a contiguous tensor or C-contiguous array ``x``: how
    the engine takes memory (never an address). A tensor whose dtype this torch cannot
    export through DLPack is exported as its bytes (a ``uint8`` view)."""
    if isinstance(x, np.ndarray):
        return _array_capsule(x)
    try:
        return _to_dlpack(x)
    except (RuntimeError, BufferError, TypeError):
        return _to_dlpack(x.detach().reshape(-1).view(torch.uint8))


def engine_tuples(entries: List[Any]) -> List[Any]:
    """``entries`` (engine tuples holding each tensor or array, or ``None``, as the memory)
    with each memory made a DLPack capsule, for one ``Engine.save`` call (a capsule is
    consumed by the call that takes it: a retry makes new ones). Column by column (``zip``):
    no Python code per tuple."""
    if not entries:
        return []
    names, dtypes, shapes, mems, nbytes, devices = zip(*entries)
    return list(zip(names, dtypes, shapes, capsules(mems), nbytes, devices))


#: The exact types whose memory :func:`capsules` exports in one ``map``.
_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter)) if torch is not None else frozenset()


def capsules(mems: Sequence[Any]) -> List[Any]:
    """:func:`capsule` of each memory (None for None). When every memory is a plain tensor
    (the common case) the capsules are made by one ``map`` of ``to_dlpack``, which is what
    :func:`capsule` calls first for each; when one raises what :func:`capsule` falls back
    on, the capsules made are dropped (unconsumed: freed by their producer) and each memory
    goes through :func:`capsule`, as without the fast path."""
    if _PLAIN_TENSORS.issuperset(map(type, mems)):
        try:
            return list(map(_to_dlpack, mems))
        except (RuntimeError, BufferError, TypeError):
            pass
    return [None if m is None else capsule(m) for m in mems]


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
    """The memory of a C-contiguous destination ``x`` as a flat ``uint8`` array sharing it:
    a numpy array or CPU tensor gives a numpy view, a CUDA tensor a CUDA ``uint8`` tensor.
    Raises ``ValueError`` for a non-contiguous one."""
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError("a load destination must be C-contiguous")
        return x.reshape(-1).view(np.uint8)
    d = x.detach()
    if not d.is_contiguous():
        raise ValueError("a load destination must be contiguous")
    flat = d.reshape(-1).view(torch.uint8)
    return flat if flat.device.type == "cuda" else flat.numpy()


def dest_capsule(x: Any) -> Any:
    """A DLPack capsule of the memory of load destination ``x`` (:func:`byte_view`), for the
    engine's ``load_into*`` and the DCP reads, which check it (writable, contiguous, the
    right device and length). Raises ``ValueError`` for a non-contiguous or read-only one."""
    v = byte_view(x)
    if isinstance(v, np.ndarray):
        if not v.flags.writeable:
            raise ValueError("a load destination must be writable")
        return v.__dlpack__()
    return _to_dlpack(v)
