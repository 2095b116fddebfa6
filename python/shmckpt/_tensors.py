"""The dtypes safetensors stores (torch and numpy, both ways) and the per-tensor checks of
flattening: what a tensor's memory holds (refused kinds, conjugate and negative views) and
the host array a numpy value is stored from (little-endian, C-contiguous)."""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .errors import UnsupportedValue

try:  # torch is optional: numpy-only states work without it.
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None  # type: ignore[assignment]


def _torch_dtypes() -> Dict[Any, str]:
    if torch is None:
        return {}
    pairs = [
        ("float64", "F64"),
        ("float32", "F32"),
        ("float16", "F16"),
        ("bfloat16", "BF16"),
        ("int64", "I64"),
        ("int32", "I32"),
        ("int16", "I16"),
        ("int8", "I8"),
        ("uint8", "U8"),
        ("bool", "BOOL"),
        ("float8_e4m3fn", "F8_E4M3"),
        ("float8_e5m2", "F8_E5M2"),
        ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
        ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
        ("float8_e8m0fnu", "F8_E8M0"),
        ("uint16", "U16"),
        ("uint32", "U32"),
        ("uint64", "U64"),
        ("complex64", "C64"),
    ]
    out = {}
    for tname, st in pairs:
        dt = getattr(torch, tname, None)
        if dt is not None:
            out[dt] = st
    return out


#: torch dtype -> safetensors dtype name.
TORCH_TO_ST: Dict[Any, str] = _torch_dtypes()
#: safetensors dtype name -> torch dtype (the first torch dtype for each name).
ST_TO_TORCH: Dict[str, Any] = {v: k for k, v in TORCH_TO_ST.items()}

#: numpy dtype (little-endian, the byte order of safetensors) -> safetensors dtype name.
NUMPY_TO_ST: Dict[np.dtype, str] = {
    np.dtype("<f8"): "F64",
    np.dtype("<f4"): "F32",
    np.dtype("<f2"): "F16",
    np.dtype("<i8"): "I64",
    np.dtype("<i4"): "I32",
    np.dtype("<i2"): "I16",
    np.dtype("i1"): "I8",
    np.dtype("<u8"): "U64",
    np.dtype("<u4"): "U32",
    np.dtype("<u2"): "U16",
    np.dtype("u1"): "U8",
    np.dtype("?"): "BOOL",
    np.dtype("<c8"): "C64",
}
ST_TO_NUMPY: Dict[str, np.dtype] = {v: k for k, v in NUMPY_TO_ST.items()}


def torch_dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


def render_path(path: Tuple[Any, ...]) -> str:
    """``state['model']['w'][0]``: how error messages name a key path."""
    return "state" + "".join(f"[{k!r}]" for k in path)


def _unsupported(path: Tuple[Any, ...], what: str) -> UnsupportedValue:
    where = render_path(path)
    return UnsupportedValue(f"{where}: {what}", key=where)


def little_endian(dt: np.dtype) -> np.dtype:
    """``dt`` in little-endian byte order (itself when it already is or has no order)."""
    if dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big"):
        return dt.newbyteorder("<")
    return dt


def host_array(a: np.ndarray, fresh: bool = False) -> np.ndarray:
    """The bytes to store of ``a``: a C-contiguous, little-endian base ndarray of the same
    shape (0-d stays 0-d) and values; ``a`` itself when it already is one, unless ``fresh``
    asks for a copy the caller owns."""
    le = little_endian(a.dtype)
    if le is not a.dtype or not a.flags.c_contiguous or type(a) is not np.ndarray:
        return np.array(a, dtype=le, order="C", subok=False, copy=True)
    return a.copy() if fresh else a


_PLAIN_TENSOR: Any = torch.Tensor if torch is not None else None
_PARAMETER: Any = torch.nn.Parameter if torch is not None else None
_TENSOR_DISPATCH: Any = torch.Tensor.__torch_dispatch__ if torch is not None else None


def tensor_problem(x: Any) -> Optional[str]:
    """Why the memory of tensor ``x`` does not hold its values (so it cannot be saved or
    loaded into by address), or ``None``. Conjugate and negative views are not problems
    (they are resolved, see :func:`resolved`); an unsupported dtype is checked apart."""
    if x.layout != torch.strided:
        return f"{x.layout} tensors are not supported"
    if not (x.is_cpu or x.is_cuda):
        return f"tensors on {x.device} are not supported (cpu, cuda)"
    tx = type(x)
    if tx is not _PLAIN_TENSOR and tx is not _PARAMETER:
        if getattr(tx, "__torch_dispatch__", _TENSOR_DISPATCH) is not _TENSOR_DISPATCH:
            return (
                f"tensor subclass {tx.__module__}.{tx.__qualname__} has its own "
                "__torch_dispatch__: its memory is not its values (save its inner tensors)"
            )
    if x.is_nested:
        return "nested tensors are not supported"
    n = x.numel()
    if n == 0:
        return None
    # (A functional tensor's storage, like a freed one's, has a null address.)
    if x.data_ptr() == 0:
        return (
            "the tensor has no data in memory (a functional, fake or freed tensor, such as "
            "a parameter whose storage was resized to 0)"
        )
    span = n if x.is_contiguous() else 1 + sum((s - 1) * st for s, st in zip(x.shape, x.stride()))
    if (x.storage_offset() + span) * x.element_size() > x.untyped_storage().nbytes():
        return "the tensor's storage is smaller than its shape and strides need (resized?)"
    return None


def check_tensor(x: Any, key: str, context: str = "") -> None:
    """Raise :class:`~shmckpt.errors.UnsupportedValue` (``context``, ``key`` and the reason)
    when :func:`tensor_problem` finds one in ``x``."""
    problem = tensor_problem(x)
    if problem is not None:
        raise UnsupportedValue(f"{context}{key}: {problem}", key=key)


def is_lazy(x: Any) -> bool:
    """Whether ``x`` is a conjugate or negative view: its memory holds the values of the
    tensor it views, and the bit says to conjugate or negate them when read."""
    return bool(x.is_conj() or x.is_neg())


def resolved(x: Any) -> Any:
    """``x`` with its conjugate and negative bits applied (a new tensor when one is set)."""
    if x.is_conj():
        x = x.resolve_conj()
    if x.is_neg():
        x = x.resolve_neg()
    return x


def raw_view(x: Any) -> Tuple[Any, Any]:
    """For a conjugate or negative view ``x``: a view of the same memory with neither bit
    (what the memory holds), and the function that turns a copy of that view (on any
    device) into ``x``'s values. Lets a device tensor's values be made on the host, with
    no device memory allocated."""
    conj, neg = bool(x.is_conj()), bool(x.is_neg())
    if conj:
        x = x.conj()  # toggles the bit: a view of the memory as it is
    if neg:
        x = torch._neg_view(x)

    def apply(copy: Any) -> Any:
        if conj:
            copy = copy.conj()
        if neg:
            copy = torch._neg_view(copy)
        return resolved(copy)

    return x, apply
