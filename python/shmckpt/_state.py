"""Flattening of nested training state into named tensors plus a typed JSON skeleton.

Naming: the flat name of a tensor is its key path joined with ``.``: dict keys as they
are (``str``) or in decimal (``int``), list and tuple indices in decimal. So
``{"model": {"layer.0.weight": w}, "optim": {"state": {0: {"exp_avg": m}}}}`` gives the
tensors ``model.layer.0.weight`` and ``optim.state.0.exp_avg``. These are the names a plain
safetensors reader (``safetensors.torch.load_file``) sees.

Everything else (the containers and plain values: ``int``, ``float`` incl. inf/nan,
``bool``, ``str``, ``None``) is the *skeleton*: typed JSON stored in the safetensors
``__metadata__`` under :data:`STATE_KEY`, never pickle. Loading rebuilds the exact nested
structure with the same Python types (dict / OrderedDict with str or int keys, list,
tuple).
"""

from __future__ import annotations

import collections
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

try:  # torch is optional: numpy-only states work without it.
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None  # type: ignore[assignment]

#: Metadata key of the skeleton (keys starting with ``shmckpt.`` are reserved by the engine).
STATE_KEY = "shmckpt_py.state"
#: Version of the skeleton format.
FORMAT_VERSION = 1


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

#: numpy dtype (native byte order) -> safetensors dtype name.
NUMPY_TO_ST: Dict[np.dtype, str] = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint64): "U64",
    np.dtype(np.uint32): "U32",
    np.dtype(np.uint16): "U16",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.complex64): "C64",
}
ST_TO_NUMPY: Dict[str, np.dtype] = {v: k for k, v in NUMPY_TO_ST.items()}


def torch_dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


def render_path(path: Tuple[Any, ...]) -> str:
    """``state['model']['w'][0]``: how error messages name a key path."""
    return "state" + "".join(f"[{k!r}]" for k in path)


@dataclass
class Leaf:
    """One tensor or array of the state."""

    name: str
    path: Tuple[Any, ...]
    obj: Any
    kind: str  # "tensor" or "ndarray"
    dtype: str  # safetensors name
    alias_of: Optional[str] = None  # set for a second key of the same tensor


@dataclass
class Flat:
    tree: Any
    leaves: List[Leaf] = field(default_factory=list)

    def stored(self) -> List[Leaf]:
        """The leaves whose bytes are written (aliases are not)."""
        return [lf for lf in self.leaves if lf.alias_of is None]


_PLAIN_TENSOR: Any = torch.Tensor if torch is not None else None
_PARAMETER: Any = torch.nn.Parameter if torch is not None else None
_DTENSOR_CLS: Any = None  # the DTensor class once imported; False when unavailable


def _dtensor_cls() -> Any:
    global _DTENSOR_CLS
    cls = _DTENSOR_CLS
    if cls is None:
        cls = False
        if torch is not None:
            try:
                from torch.distributed.tensor import DTensor as cls  # torch >= 2.4
            except Exception:  # pragma: no cover
                try:
                    from torch.distributed._tensor import DTensor as cls  # type: ignore[no-redef]
                except Exception:
                    cls = False
        _DTENSOR_CLS = cls
    return cls


def _is_dtensor(x: Any) -> bool:
    tx = type(x)
    if tx is _PLAIN_TENSOR or tx is _PARAMETER:
        return False  # neither is a DTensor subclass (isinstance is slow for tensors)
    cls = _DTENSOR_CLS if _DTENSOR_CLS is not None else _dtensor_cls()
    return cls is not False and isinstance(x, cls)


def _dtensor_local(x: Any, path: Tuple[Any, ...]) -> Tuple[Any, Dict[str, Any]]:
    """The local shard of a DTensor and its place in the global tensor."""
    from torch.distributed.tensor import Shard, Replicate  # torch >= 2.4

    local = x.to_local()
    gshape = list(x.shape)
    offsets = [0] * len(gshape)
    mesh = x.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise TypeError(f"{render_path(path)}: DTensor not on this rank's mesh")
    sharded = set()
    for mesh_dim, pl in enumerate(x.placements):
        if isinstance(pl, Replicate):
            continue
        if not isinstance(pl, Shard):
            raise TypeError(
                f"{render_path(path)}: DTensor placement {pl} is not supported (Shard and "
                "Replicate are)"
            )
        d = pl.dim
        if d in sharded:
            raise TypeError(
                f"{render_path(path)}: DTensor sharded twice along dim {d} is not supported"
            )
        sharded.add(d)
        n = mesh.size(mesh_dim)
        c = coord[mesh_dim]
        # torch.chunk semantics (what Shard uses): ceil-sized pieces, the last ones smaller.
        full = gshape[d]
        piece = -(-full // n) if n else 0
        offsets[d] += min(c * piece, full)
    info = {
        "global_shape": gshape,
        "global_offset": offsets,
        "placements": [str(p) for p in x.placements],
        "mesh_shape": list(mesh.shape),
    }
    return local, info


def flatten(state: Any) -> Flat:
    """Split ``state`` into tensor leaves and a JSON-able skeleton.

    Raises ``TypeError`` (naming the key path) for anything unsupported and ``ValueError``
    when two key paths give the same flat name.
    """
    leaves: List[Leaf] = []
    names: Dict[str, Tuple[Any, ...]] = {}
    seen: Dict[Tuple[Any, ...], str] = {}

    def claim(name: str, path: Tuple[Any, ...]) -> None:
        if name in names:
            raise ValueError(
                f"{render_path(path)} and {render_path(names[name])} both flatten to the "
                f"tensor name {name!r}; rename one of the keys"
            )
        names[name] = path

    # Per-dtype (safetensors name, torch name), filled on first use.
    dtype_info: Dict[Any, Tuple[str, str]] = {}
    tensor_cls = torch.Tensor if torch is not None else None
    param_cls = torch.nn.Parameter if torch is not None else None
    strided = torch.strided if torch is not None else None

    def walk(x: Any, path: Tuple[Any, ...], name: str) -> Any:
        # ``name`` is ``".".join(str(k) for k in path)``, built incrementally.
        t = type(x)
        if tensor_cls is not None and isinstance(x, tensor_cls):
            node: Dict[str, Any]
            if _is_dtensor(x):
                x, info = _dtensor_local(x, path)
                node = {"dtensor": info}
            else:
                node = {}
            if x.layout != strided:
                raise TypeError(f"{render_path(path)}: {x.layout} tensors are not supported")
            if not (x.is_cpu or x.is_cuda):  # (faster than reading device.type)
                raise TypeError(
                    f"{render_path(path)}: tensors on {x.device} are not supported (cpu, cuda)"
                )
            xdt = x.dtype
            di = dtype_info.get(xdt)
            if di is None:
                st = TORCH_TO_ST.get(xdt)
                if st is None:
                    raise TypeError(
                        f"{render_path(path)}: dtype {xdt} has no safetensors equivalent; "
                        f"supported: {', '.join(sorted(torch_dtype_name(d) for d in TORCH_TO_ST))}"
                    )
                di = dtype_info[xdt] = (st, torch_dtype_name(xdt))
            if not path:
                raise TypeError("state: the top level must be a dict, list or tuple")
            if name in names:
                claim(name, path)  # raises
            names[name] = path
            node["t"] = "tensor"
            node["n"] = name
            node["dtype"] = di[1]
            # isinstance(x, Parameter) runs Python code (_ParameterMeta.__instancecheck__):
            # a plain tensor is a Parameter only if it has ``_is_param`` set.
            if t is param_cls or (
                (t is not tensor_cls or getattr(x, "_is_param", False))
                and isinstance(x, param_cls)
            ):
                node["param"] = True
                node["requires_grad"] = bool(x.requires_grad)
            alias = None
            if x.numel() > 0:
                key = (x.device, x.data_ptr(), xdt, tuple(x.shape), tuple(x.stride()))
                alias = seen.get(key)
                if alias is None:
                    seen[key] = name
                else:
                    node["alias"] = alias
            leaves.append(Leaf(name, path, x, "tensor", di[0], alias))
            return node
        if isinstance(x, np.ndarray):
            if not path:
                raise TypeError("state: the top level must be a dict, list or tuple")
            dt = x.dtype.newbyteorder("=") if x.dtype.byteorder not in ("=", "|") else x.dtype
            st = NUMPY_TO_ST.get(dt)
            if st is None:
                raise TypeError(
                    f"{render_path(path)}: numpy dtype {x.dtype} is not supported"
                )
            claim(name, path)
            leaves.append(Leaf(name, path, x, "ndarray", st))
            return {"t": "ndarray", "n": name, "dtype": dt.str}
        if t is dict or t is collections.OrderedDict:
            items = []
            for k, v in x.items():
                kt = type(k)
                if kt is str:
                    items.append(["s", k, walk(v, path + (k,), f"{name}.{k}" if path else k)])
                elif kt is int:
                    sk = str(k)
                    items.append(["i", sk, walk(v, path + (k,), f"{name}.{sk}" if path else sk)])
                else:
                    raise TypeError(
                        f"{render_path(path)}: key {k!r} of type {kt.__name__} is not "
                        "supported (str and int keys are)"
                    )
            return {"t": "odict" if t is collections.OrderedDict else "dict", "v": items}
        if t is list or t is tuple:
            return {
                "t": t.__name__,
                "v": [
                    walk(v, path + (i,), f"{name}.{i}" if path else str(i))
                    for i, v in enumerate(x)
                ],
            }
        if x is None:
            return {"t": "none"}
        if t is bool:
            return {"t": "bool", "v": x}
        if t is int:
            return {"t": "int", "v": str(x)}
        if t is float:
            return {"t": "float", "v": repr(x) if math.isfinite(x) else str(x)}
        if t is str:
            return {"t": "str", "v": x}
        raise TypeError(
            f"{render_path(path)}: values of type {t.__module__}.{t.__qualname__} cannot be "
            "saved (tensors, numpy arrays, dict/list/tuple, int, float, bool, str and None can)"
        )

    if type(state) not in (dict, collections.OrderedDict, list, tuple):
        raise TypeError(
            f"state must be a dict, list or tuple, not {type(state).__qualname__}"
        )
    tree = walk(state, (), "")
    for lf in leaves:
        if lf.name == "":
            raise ValueError(f"{render_path(lf.path)}: empty tensor name")
    return Flat(tree, leaves)


def encode(flat: Flat) -> str:
    return json.dumps(
        {"format": FORMAT_VERSION, "tree": flat.tree},
        ensure_ascii=False,
        allow_nan=False,
        separators=(",", ":"),
    )


def decode(text: str) -> Any:
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
        raise ValueError(f"unknown shmckpt state format {doc.get('format') if isinstance(doc, dict) else doc!r}")
    return doc["tree"]


def tensor_nodes(tree: Any) -> List[Dict[str, Any]]:
    """Every tensor/ndarray node of a skeleton, in order."""
    out: List[Dict[str, Any]] = []

    def walk(n: Any) -> None:
        t = n.get("t")
        if t in ("tensor", "ndarray"):
            out.append(n)
        elif t in ("dict", "odict"):
            for _, _, c in n["v"]:
                walk(c)
        elif t in ("list", "tuple"):
            for c in n["v"]:
                walk(c)

    walk(tree)
    return out


def unflatten(tree: Any, lookup: Any) -> Any:
    """Rebuild the nested state; ``lookup(node)`` returns the object for a tensor node."""

    def build(n: Any) -> Any:
        if not isinstance(n, dict) or "t" not in n:
            raise ValueError(f"malformed state skeleton node {n!r:.80}")
        t = n["t"]
        if t in ("tensor", "ndarray"):
            return lookup(n)
        if t in ("dict", "odict"):
            d: Any = collections.OrderedDict() if t == "odict" else {}
            for kt, k, c in n["v"]:
                d[int(k) if kt == "i" else k] = build(c)
            return d
        if t == "list":
            return [build(c) for c in n["v"]]
        if t == "tuple":
            return tuple(build(c) for c in n["v"])
        if t == "none":
            return None
        if t == "bool":
            return bool(n["v"])
        if t == "int":
            return int(n["v"])
        if t == "float":
            return float(n["v"])
        if t == "str":
            return str(n["v"])
        raise ValueError(f"unknown state skeleton node type {t!r}")

    return build(tree)
