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

Values are stored by value (see docs/guarantees.md, "Byte order and lazy tensors"): numpy
arrays of big-endian dtypes are converted to little-endian (safetensors' byte order),
conjugate and negative views are resolved, and tensors whose memory does not hold their
values (sparse, nested, meta, fake, functional or freed tensors, subclasses with their own
``__torch_dispatch__``) are refused with :class:`~shmckpt.errors.UnsupportedValue`.
"""

from __future__ import annotations

import collections
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .errors import UnsupportedValue

try:  # torch is optional: numpy-only states work without it.
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None  # type: ignore[assignment]

#: Metadata key of the skeleton (keys starting with ``shmckpt.`` are reserved by the engine).
STATE_KEY = "shmckpt_py.state"
#: Version of the skeleton format.
FORMAT_VERSION = 1
#: Deepest nesting of containers a state may have (``save`` refuses deeper states, a
#: skeleton nested deeper is corrupt): bounds every recursion over a state or skeleton
#: well below Python's recursion limit, including the JSON codec's (3 JSON levels a level).
MAX_DEPTH = 100

# The dtype tables and per-tensor checks (in _tensors.py) are part of this module's names.
from ._tensors import (  # noqa: E402,F401
    _PARAMETER,
    _PLAIN_TENSOR,
    _TENSOR_DISPATCH,
    NUMPY_TO_ST,
    ST_TO_NUMPY,
    ST_TO_TORCH,
    TORCH_TO_ST,
    _unsupported,
    check_tensor,
    host_array,
    is_lazy,
    little_endian,
    raw_view,
    render_path,
    resolved,
    tensor_problem,
    torch_dtype_name,
)


@dataclass
class Leaf:
    """One tensor or array of the state."""

    name: str
    path: Tuple[Any, ...]
    obj: Any
    kind: str  # "tensor" or "ndarray"
    dtype: str  # safetensors name
    alias_of: Optional[str] = None  # set for a second key of the same tensor
    #: A tensor whose memory holds other values than it reads as (a conjugate or negative
    #: view): its bytes are those of :func:`resolved`, never its memory.
    lazy: bool = False


@dataclass
class Flat:
    tree: Any
    leaves: List[Leaf] = field(default_factory=list)

    def stored(self) -> List[Leaf]:
        """The leaves whose bytes are written (aliases are not)."""
        return [lf for lf in self.leaves if lf.alias_of is None]


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
        raise _unsupported(path, "DTensor not on this rank's mesh")
    sharded = set()
    for mesh_dim, pl in enumerate(x.placements):
        if isinstance(pl, Replicate):
            continue
        if not isinstance(pl, Shard):
            raise _unsupported(path, f"DTensor placement {pl} is not supported (Shard and Replicate are)")
        d = pl.dim
        if d in sharded:
            raise _unsupported(path, f"DTensor sharded twice along dim {d} is not supported")
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


def _check_text(text: str, path: Tuple[Any, ...], what: str) -> None:
    """:class:`UnsupportedValue` naming ``path`` unless ``text`` can be stored as UTF-8 (a
    lone surrogate, as ``os.fsdecode`` makes of undecodable bytes, cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _unsupported(
            path,
            f"the {what} {text!r} is not valid Unicode text ({e.reason}: {text[e.start:e.end]!r} "
            f"at {e.start}); only text that UTF-8 can encode is saved",
        ) from None


def flatten(state: Any) -> Flat:
    """Split ``state`` into tensor leaves and a JSON-able skeleton.

    Raises :class:`~shmckpt.errors.UnsupportedValue` (a ``TypeError`` naming the key path)
    for anything unsupported and ``ValueError`` when two key paths give the same flat name.
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
            problem = tensor_problem(x)
            if problem is not None:
                raise _unsupported(path, problem)
            xdt = x.dtype
            di = dtype_info.get(xdt)
            if di is None:
                st = TORCH_TO_ST.get(xdt)
                if st is None:
                    raise _unsupported(
                        path,
                        f"dtype {xdt} has no safetensors equivalent; supported: "
                        f"{', '.join(sorted(torch_dtype_name(d) for d in TORCH_TO_ST))}",
                    )
                di = dtype_info[xdt] = (st, torch_dtype_name(xdt))
            if not path:
                raise UnsupportedValue("state: the top level must be a dict, list or tuple", key="state")
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
            # A conjugate or negative view reads as other values than its memory holds.
            conj, neg = bool(x.is_conj()), bool(x.is_neg())
            lazy = conj or neg
            if x.numel() > 0:
                # Same memory, layout and dtype, and the same lazy bits: the same values.
                key = (x.device, x.data_ptr(), xdt, tuple(x.shape), tuple(x.stride()), conj, neg)
                alias = seen.get(key)
                if alias is None:
                    seen[key] = name
                else:
                    node["alias"] = alias
            leaves.append(Leaf(name, path, x, "tensor", di[0], alias, lazy))
            return node
        if isinstance(x, np.ndarray):
            if not path:
                raise UnsupportedValue("state: the top level must be a dict, list or tuple", key="state")
            if isinstance(x, np.ma.MaskedArray):
                raise _unsupported(path, "masked arrays are not supported (their mask would be lost)")
            # Stored little-endian, by value (host_array converts a big-endian array).
            dt = little_endian(x.dtype)
            st = NUMPY_TO_ST.get(dt)
            if st is None:
                raise _unsupported(path, f"numpy dtype {x.dtype} is not supported")
            claim(name, path)
            leaves.append(Leaf(name, path, x, "ndarray", st))
            return {"t": "ndarray", "n": name, "dtype": dt.str}
        if len(path) >= MAX_DEPTH:
            raise _unsupported(path, f"the state is nested deeper than {MAX_DEPTH} levels")
        if t is dict or t is collections.OrderedDict:
            items = []
            for k, v in x.items():
                kt = type(k)
                if kt is str:
                    if not k.isascii():
                        _check_text(k, path + (k,), "key")
                    items.append(["s", k, walk(v, path + (k,), f"{name}.{k}" if path else k)])
                elif kt is int:
                    sk = str(k)
                    items.append(["i", sk, walk(v, path + (k,), f"{name}.{sk}" if path else sk)])
                else:
                    raise _unsupported(
                        path, f"key {k!r} of type {kt.__name__} is not supported (str and int keys are)"
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
            if not x.isascii():
                _check_text(x, path, "string")
            return {"t": "str", "v": x}
        raise _unsupported(
            path,
            f"values of type {t.__module__}.{t.__qualname__} cannot be saved (tensors, numpy "
            "arrays, dict/list/tuple, int, float, bool, str and None can)",
        )

    if type(state) not in (dict, collections.OrderedDict, list, tuple):
        raise UnsupportedValue(
            f"state must be a dict, list or tuple, not {type(state).__qualname__}", key="state"
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
    """The skeleton of an encoded state, checked by :func:`check_tree`. Raises
    ``ValueError`` for anything malformed (nesting too deep for the JSON parser included)."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError("the skeleton JSON is nested too deeply") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
        raise ValueError(f"unknown shmckpt state format {doc.get('format') if isinstance(doc, dict) else doc!r:.80}")
    tree = doc.get("tree")
    check_tree(tree)
    return tree


_LEAF_FIELDS = {
    "none": (),
    "bool": (("v", bool),),
    "int": (("v", str),),
    "float": (("v", str),),
    "str": (("v", str),),
    "ndarray": (("n", str), ("dtype", str)),
    "tensor": (("n", str),),
}
#: Optional fields of tensor nodes and their types.
_TENSOR_OPTIONAL = (("alias", str), ("dtype", str), ("param", bool), ("requires_grad", bool), ("dtensor", dict))


def check_tree(tree: Any) -> None:
    """Check that ``tree`` (read from a file: untrusted) is a well-formed skeleton, nested
    at most :data:`MAX_DEPTH` levels, so that :func:`unflatten` and :func:`tensor_nodes`
    meet only nodes they know. Iterative (no recursion); raises ``ValueError``."""
    stack: List[Tuple[Any, int]] = [(tree, 0)]
    while stack:
        n, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"the skeleton is nested deeper than {MAX_DEPTH} levels")
        t = n.get("t") if isinstance(n, dict) else None
        if not isinstance(t, str):
            raise ValueError(f"malformed state skeleton node {n!r:.80}")
        if t in ("dict", "odict", "list", "tuple"):
            v = n.get("v")
            if not isinstance(v, list):
                raise ValueError(f"state skeleton {t} node without a list of items: {n!r:.80}")
            if t in ("dict", "odict"):
                for item in v:
                    if not (
                        isinstance(item, list)
                        and len(item) == 3
                        and item[0] in ("s", "i")
                        and isinstance(item[1], str)
                    ):
                        raise ValueError(f"malformed state skeleton dict item {item!r:.80}")
                    stack.append((item[2], depth + 1))
            else:
                stack.extend((c, depth + 1) for c in v)
            continue
        fields = _LEAF_FIELDS.get(t)
        if fields is None:
            raise ValueError(f"unknown state skeleton node type {t!r:.80}")
        for k, typ in fields:
            if type(n.get(k)) is not typ:
                raise ValueError(f"state skeleton {t} node without a valid {k!r}: {n!r:.80}")
        if t == "tensor":
            for k, typ in _TENSOR_OPTIONAL:
                if k in n and type(n[k]) is not typ:
                    raise ValueError(f"state skeleton tensor node with an invalid {k!r}: {n!r:.80}")


def tensor_nodes(tree: Any) -> List[Dict[str, Any]]:
    """Every tensor/ndarray node of a skeleton (checked by :func:`check_tree`), in order."""
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
