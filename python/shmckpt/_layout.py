"""The layout cache of ``Checkpointer.save``: a state saved again with the same structure and
the same tensor metadata reuses what flattening it gave the save before (names, aliases,
lazy bits, the skeleton JSON) and the engine tuples of the tensors staged from their own
memory. A repeated save then costs one walk of the containers and a few metadata reads per
tensor, each done for all tensors at once (``map`` over a method), instead of
:func:`~shmckpt._state.flatten`, the JSON encoding and the capture of every tensor.

What is compared (a layout is reused only when all of it is equal):

* the containers, node for node: their exact types (``dict``, ``OrderedDict``, ``list``,
  ``tuple``), their keys (exact ``str`` or ``int``, in order) and lengths;
* the plain values: their exact types (``int``, ``float``, ``str``, ``bool``, ``None``: ``True``
  is not an ``int`` here, nor ``1.0``). Not their values: a state differing from the
  layout's only in plain values (a step counter, an epoch, a learning rate) reuses it, its
  skeleton the layout's cut at the values (:func:`_template`) and joined with the new ones,
  each encoded as flattening it would (:func:`_fill`; a ``float`` by its ``repr``, as the
  skeleton stores it: ``-0.0`` is not ``0.0``). The same values: the layout's skeleton. (A
  skeleton with a name or key that holds the marker of the cut cannot be cut: a change of
  its values is a miss.);
* numpy arrays: exact type ``np.ndarray`` and dtype (their bytes are captured at every save);
* tensors: exact type (``torch.Tensor`` or ``torch.nn.Parameter``), ``_is_param``, layout,
  nestedness, device, dtype, ``requires_grad``, shape, strides, storage offset, address,
  conjugate and negative bits and the size of the storage. That is everything
  :func:`~shmckpt._state.flatten` reads of a tensor (the checks of
  :func:`~shmckpt._state.tensor_problem`, the alias key, the dtype, the Parameter flags)
  and everything an engine tuple holds (shape, address, length, device).

Anything else (a DTensor or another tensor subclass, an array subclass, a value of another
type, nesting of :data:`~shmckpt._state.MAX_DEPTH` levels) makes a state uncacheable: it is
flattened at every save, which raises what it raises. A metadata read that raises (e.g. the
strides of a sparse tensor) is a miss, never an error of its own. Tensor bytes are never
cached: the engine reads every tensor's bytes at every save, from the tensors compared
above (a DLPack capsule of each, made at the call). What flattening and capturing read is cached only once checked against the probe
taken before (:meth:`Layout.of`, :func:`fits`; the skeleton node for node, plain values
included): everything cached is then what the probe's key gives, even when another thread
changed the state during the save and back. The plain values of a hit are the probe's, read
once: its skeleton is built from them, and a hit changes no cached value or skeleton.
"""

from __future__ import annotations

import collections
import json
import math
import operator
from typing import Any, List, Optional, Sequence, Set, Tuple

import numpy as np

from . import _state
from ._state import MAX_DEPTH, TORCH_TO_ST, Flat, Leaf

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]

_T: Any = torch.Tensor if torch is not None else None
_P: Any = torch.nn.Parameter if torch is not None else None
_STORAGE: Any = torch.UntypedStorage if torch is not None else None
_ND = np.ndarray
_OD = collections.OrderedDict
_KEY_TYPES = frozenset((str, int))
#: The tensor types a walk takes as leaves (exact types: no subclass).
_TENSOR_TYPES = frozenset((_T, _P)) if torch is not None else frozenset()
#: How ``json.dumps(..., ensure_ascii=False)`` (:func:`~shmckpt._state.encode`) encodes a str.
_encode_str: Any = json.encoder.encode_basestring  # type: ignore[attr-defined]
#: The tensor attributes read in one call each (``operator.attrgetter`` over the list); the
#: shape is read apart (:func:`read_meta`), converted to a plain tuple.
_META = operator.attrgetter("layout", "is_nested", "device", "dtype", "requires_grad")
_SHAPE = operator.attrgetter("shape")
#: The device of each tensor's metadata (``Probe.sig[0]``).
_DEVICE = operator.itemgetter(2)


class Probe:
    """One walk of a state: its structure tokens (with the type of each plain value), its
    leaves (tensors and arrays, in :func:`~shmckpt._state.flatten`'s order), its plain values
    (``int``, ``str`` and ``bool`` as they are, a ``float`` by its ``repr``; not ``None``, which
    its token says all of) and its tensors' metadata: ``sig`` (what a layout compares:
    :func:`read_meta`), the tensors' storages and the address of each, read with it."""

    __slots__ = ("tokens", "objs", "vals", "tensor_pos", "tensors", "sig", "storages", "addresses")

    def __init__(self, tokens: List[Any], objs: List[Any], vals: List[Any]):
        self.tokens = tokens
        self.objs = objs
        self.vals = vals
        #: Index in ``objs`` of each tensor (None: every leaf is a tensor).
        self.tensor_pos: Optional[List[int]] = None
        self.tensors: List[Any] = objs
        self.sig: Optional[Tuple[List[Any], ...]] = None
        self.storages: List[Any] = []
        self.addresses: List[int] = []

    def storage_keys(self) -> List[Tuple[Any, int]]:
        """``_util._storage_key`` of each tensor: (device, address of its storage), as
        :func:`read_meta` read them."""
        assert self.sig is not None
        return list(zip(map(_DEVICE, self.sig[0]), self.addresses))


def probe(state: Any) -> Optional[Probe]:
    """Walk ``state``; None when it has a node the cache does not handle (see the module
    docstring) or a tensor whose metadata cannot be read."""
    p = walk(state)
    return None if p is None else read_meta(p)


def walk(state: Any) -> Optional[Probe]:
    """The first half of :func:`probe`: the containers of ``state``, its leaves and plain
    values, without the tensors' metadata (:func:`read_meta` reads it). Everything a later
    change of the containers could change is in it: ``save``'s deferred capture walks at
    the call and reads the metadata later."""
    if torch is None:
        return None
    ts = type(state)
    if ts is not dict and ts is not _OD and ts is not list and ts is not tuple:
        return None
    tokens: List[Any] = []
    objs: List[Any] = []
    vals: List[Any] = []
    tok = tokens.append
    obj = objs.append
    val = vals.append
    arrays = False

    def go(x: Any, depth: int) -> bool:
        nonlocal arrays
        t = type(x)
        if t is _T or t is _P:
            tok(t)
            obj(x)
            return True
        if t is dict or t is _OD or t is list or t is tuple:
            if depth >= MAX_DEPTH:
                return False
            if t is list or t is tuple:
                tok((t, len(x)))
                values = x
            else:
                keys = tuple(x)
                if not _KEY_TYPES.issuperset(map(type, keys)):
                    return False
                tok((t, keys))
                values = x.values()
            vs = values if t is tuple else list(values)
            types = list(map(type, vs))
            if _TENSOR_TYPES.issuperset(types):
                # Every value a tensor (a model's or an optimizer state's dict): by C loops.
                tokens.extend(types)
                objs.extend(vs)
                return True
            d = depth + 1
            for v, tv in zip(vs, types):
                if tv is _T or tv is _P:
                    tok(tv)
                    obj(v)
                elif not go(v, d):
                    return False
            return True
        if t is _ND:
            tok((t, x.dtype))
            obj(x)
            arrays = True
            return True
        if t is float:
            tok(t)
            val(repr(x))
            return True
        if t is int or t is str or t is bool:
            tok(t)
            val(x)
            return True
        if x is None:
            tok(None)
            return True
        return False

    if not go(state, 0):
        return None
    p = Probe(tokens, objs, vals)
    if arrays:
        p.tensor_pos = [i for i, x in enumerate(objs) if type(x) is not _ND]
        p.tensors = [objs[i] for i in p.tensor_pos]
    return p


def rebuild(p: Probe) -> Any:
    """The state :func:`walk` read into ``p``: new containers of the same types, keys and
    lengths, over the same leaves, with the same plain values (a float from its ``repr``,
    which gives it back exactly)."""
    toks, objs, vals = p.tokens, p.objs, p.vals
    at = obj = val = 0

    def node() -> Any:
        nonlocal at, obj, val
        tok = toks[at]
        at += 1
        if tok is _T or tok is _P:
            obj += 1
            return objs[obj - 1]
        if tok is None:
            return None
        if tok is int or tok is str or tok is bool or tok is float:
            val += 1
            v = vals[val - 1]
            return float(v) if tok is float else v
        typ, arg = tok
        if typ is _ND:
            obj += 1
            return objs[obj - 1]
        if typ is list or typ is tuple:
            return typ(node() for _ in range(arg))
        out = typ()
        for k in arg:
            out[k] = node()
        return out

    return node()


def read_meta(p: Probe) -> Optional[Probe]:
    """The second half of :func:`probe`: ``p`` (of :func:`walk`) with its tensors' metadata,
    or None when some cannot be read.

    ``p.sig`` is ``(meta, shapes, strides, offsets, ptrs, conj, neg, sizes, params)``, one
    list each, one item per tensor: ``meta`` the tuple (layout, is_nested, device, dtype,
    requires_grad), then the shape, strides, storage offset, address, conjugate and
    negative bits, the size of the storage and ``_is_param``. Each is read for all tensors
    at once (``map`` over a method: no Python code per tensor). ``p.addresses`` (the address
    of each storage, read with the rest) is not compared: what a storage key, a deferral
    and membership need (``save``)."""
    ts_ = p.tensors
    try:
        meta = list(map(_META, ts_))
        # Shapes as plain tuples of ints: a probe lives until the next save, and CPython
        # stops tracking a tuple of untracked values at its first collection, where a
        # ``torch.Size`` (and the tuple holding it) stays tracked and is promoted to the
        # oldest generation with the probe (~2,300 objects per save of 1,168 tensors, which
        # made a full collection of the trainer's heap run every ~20 saves).
        shapes = list(map(tuple, map(_SHAPE, ts_)))
        strides = list(map(_T.stride, ts_))
        offsets = list(map(_T.storage_offset, ts_))
        ptrs = list(map(_T.data_ptr, ts_))
        conj = list(map(_T.is_conj, ts_))
        neg = list(map(_T.is_neg, ts_))
        storages = list(map(_T.untyped_storage, ts_))
        sizes = list(map(_STORAGE.nbytes, storages))
        addresses = list(map(_STORAGE.data_ptr, storages))
        params = [bool(getattr(x, "_is_param", False)) for x in ts_]
    except Exception:
        return None
    p.sig = (meta, shapes, strides, offsets, ptrs, conj, neg, sizes, params)
    p.storages = storages
    p.addresses = addresses
    return p


def storage_addresses(p: Probe) -> Optional[List[int]]:
    """The address of the storage of each leaf of ``p`` (every leaf a tensor: else None):
    those :func:`read_meta` read with its metadata when it did, else read now (None when a
    tensor has no readable storage)."""
    if p.tensor_pos is not None:
        return None
    if p.sig is not None:
        return p.addresses
    try:
        return list(map(_STORAGE.data_ptr, map(_T.untyped_storage, p.objs)))
    except Exception:
        return None


class Plan:
    """The engine tuples of one save mode: ``entries`` (one per stored leaf, holding no
    memory: :func:`templates`), ``redo`` (``(entry index, leaf index)`` of the leaves
    captured anew at every save: copies, arrays), ``devices`` (the CUDA ordinals of the
    tensors), ``own`` (``(entry index, leaf index)`` of the leaves staged from their own
    memory: each entry gets its leaf as the memory at every save). :meth:`tuples` gives a
    save's tuples."""

    __slots__ = ("key", "entries", "redo", "devices", "own", "columns", "fill", "dense")

    def __init__(
        self,
        key: Any,
        entries: List[Any],
        redo: List[Tuple[int, int]],
        devices: List[int],
        own: List[Tuple[int, int]],
    ):
        self.key = key
        self.entries = entries
        self.redo = redo
        self.devices = devices
        self.own = own
        #: ``entries`` by column (name, dtype, shape, memory, nbytes, device), zipped anew at
        #: every save with its memories (:meth:`tuples`).
        self.columns: List[Tuple[Any, ...]] = [tuple(c) for c in zip(*entries)] if entries else [()] * 6
        #: The pairs of ``own`` whose entry has bytes (an empty tensor's has no memory),
        #: as (entry indices, leaf indices), and whether those entries are all of them, in
        #: order (then the memories are the leaves at the leaf indices, in that order).
        pairs = [(e, i) for e, i in own if entries[e][4]]
        self.fill = ([e for e, _ in pairs], [i for _, i in pairs])
        self.dense = self.fill[0] == list(range(len(entries)))

    def tuples(self, objs: Sequence[Any]) -> List[Any]:
        """The engine tuples of a save whose leaves are ``objs`` (a probe's that matched this
        plan's layout and metadata): ``entries`` with each ``own`` leaf of bytes as its
        memory (the redo entries left for ``save`` to capture), built by C loops (``map``,
        ``zip``), no Python code per tensor when ``dense``."""
        names, dtypes, shapes, _, nbytes, devices = self.columns
        if self.dense:
            mems: List[Any] = list(map(objs.__getitem__, self.fill[1]))
        else:
            mems = [None] * len(self.entries)
            for e, i in zip(*self.fill):
                mems[e] = objs[i]
        return list(zip(names, dtypes, shapes, mems, nbytes, devices))


def templates(entries: Sequence[Any]) -> List[Any]:
    """Engine tuples without their memory (``None``): what a plan keeps (no tensor kept
    alive by the cache)."""
    return [(e[0], e[1], e[2], None, e[4], e[5]) for e in entries]


class Layout:
    """What flattening a state gave, and the probe it is valid for."""

    __slots__ = ("tokens", "sig", "infos", "vals", "kinds", "parts", "skeleton", "holdable", "plan")

    def __init__(self, p: Probe, flat: Flat, skeleton: str, kinds: List[Any], parts: Optional[List[str]]):
        self.tokens = p.tokens
        self.sig = p.sig
        #: Per leaf: (name, kind, safetensors dtype, alias_of, lazy); no reference to the
        #: tensors (a cached layout keeps no memory alive).
        self.infos = [(lf.name, lf.kind, lf.dtype, lf.alias_of, lf.lazy) for lf in flat.leaves]
        #: The plain values the skeleton holds (the probe's) and the type of each.
        self.vals = p.vals
        self.kinds = kinds
        #: The skeleton cut at its plain values (one more part than values; None when it
        #: cannot be, see :func:`_template`): a state differing only in these values gets its
        #: skeleton by :func:`_fill`.
        self.parts = parts
        self.skeleton = skeleton
        #: Every leaf an alias, an array, a host tensor or contiguous (``save``'s ``hold``).
        self.holdable = _holdable(p, self.infos)
        self.plan: Optional[Plan] = None

    @staticmethod
    def of(p: Optional[Probe], flat: Flat) -> Optional["Layout"]:
        """The layout of ``flat`` for probe ``p`` of the same state (None when the state is
        uncacheable or the probe does not describe ``flat``'s leaves and skeleton). Its
        ``skeleton`` is the encoding of ``flat`` (:func:`~shmckpt._state.encode`)."""
        if p is None or p.sig is None or len(p.objs) != len(flat.leaves):
            return None
        if any(a is not lf.obj for a, lf in zip(p.objs, flat.leaves)):
            return None
        # What flatten read of each tensor is what the probe read (a tensor changed while
        # it was flattened, by another thread, is not cached): the dtype, the lazy bits
        # and the aliases, which say how its bytes read.
        assert p.sig is not None
        meta, shapes, strides, _, ptrs, conj, neg, _, _ = p.sig
        leaves = flat.leaves if p.tensor_pos is None else [flat.leaves[i] for i in p.tensor_pos]
        seen: dict = {}
        for j, lf in enumerate(leaves):
            dtype, shape = meta[j][3], shapes[j]
            if lf.dtype != TORCH_TO_ST.get(dtype) or lf.lazy != (conj[j] or neg[j]):
                return None
            alias = None
            if math.prod(shape) > 0:
                key = (meta[j][2], ptrs[j], dtype, tuple(shape), tuple(strides[j]), conj[j], neg[j])
                alias = seen.setdefault(key, lf.name)
                alias = None if alias == lf.name else alias
            if lf.alias_of != alias:
                return None
        slots = _tree_fits(p, flat.tree)
        if slots is None:
            return None
        # The skeleton of the probe's values (those of the tree, just checked), cut at them.
        kinds = [t for t in p.tokens if t is int or t is float or t is str or t is bool]
        parts = _template(flat.tree, slots) if slots else None
        skeleton = _state.encode(flat) if parts is None else _fill(parts, kinds, p.vals)
        return Layout(p, flat, skeleton, kinds, parts)

    def skeleton_for(self, p: Optional[Probe]) -> Optional[str]:
        """The skeleton of the state of probe ``p`` when it has this layout (the same
        structure, the same type at each plain value, the same metadata), else None: this
        layout's when its plain values are the same, else this layout's with ``p``'s values
        (None when it has no parts)."""
        if p is None or p.tokens != self.tokens or p.sig != self.sig:
            return None
        return self.skeleton_of(p.vals)

    def skeleton_of(self, vals: List[Any]) -> Optional[str]:
        """The skeleton of a state of this layout whose plain values are ``vals`` (a probe's
        or a walk's with this layout's tokens: the same type at each value): this layout's
        when they are its values, else filled in (None when it has no parts)."""
        if vals == self.vals:  # the types are the tokens': == is exact (floats by repr)
            return self.skeleton
        if self.parts is None:
            return None
        return _fill(self.parts, self.kinds, vals)

    def leaf(self, i: int, x: Any) -> Leaf:
        """Leaf ``i`` of this layout, over ``x`` (a matching probe's leaf ``i``)."""
        name, kind, dtype, alias, lazy = self.infos[i]
        return Leaf(name, (), x, kind, dtype, alias, lazy)

    def leaves(self, objs: Sequence[Any]) -> List[Leaf]:
        """The leaves of this layout over ``objs`` (a matching probe's)."""
        return [self.leaf(i, x) for i, x in enumerate(objs)]


#: What stands for the plain values in the encoding cut into a template: JSON escapes its
#: control characters, and its encoding holds no ``"`` inside, no ``:`` and no ``}`` (what
#: precedes and follows a value in a skeleton), so it occurs once per value and elsewhere
#: only inside another string, which :func:`_template` detects.
_SLOT = "\x00shmckpt.value\x00"
_SLOT_JSON = json.dumps(_SLOT)


def _template(tree: Any, slots: List[Any]) -> Optional[List[str]]:
    """The encoding of skeleton ``tree`` cut at the values of ``slots`` (its plain nodes
    with a value, in order): ``len(slots) + 1`` strings, or None when a name, key or other
    string of the skeleton holds what stands for a value."""
    saved = [n["v"] for n in slots]
    try:
        for n in slots:
            n["v"] = _SLOT
        text = _state.encode(Flat(tree))
    finally:
        for n, v in zip(slots, saved):
            n["v"] = v
    parts = text.split(_SLOT_JSON)
    return parts if len(parts) == len(slots) + 1 else None


def _fill(parts: List[str], kinds: Sequence[Any], vals: Sequence[Any]) -> str:
    """The skeleton of template ``parts`` with plain values ``vals`` of types ``kinds``
    (a float by its ``repr``), encoded as :func:`~shmckpt._state.flatten` and
    :func:`~shmckpt._state.encode` do: an int as the JSON string of its decimal digits
    (``ValueError`` beyond ``sys.get_int_max_str_digits()``, as flatten), a float as the
    JSON string of its ``repr``, a bool as ``true`` or ``false``, a str as JSON (not
    ASCII-escaped)."""
    out = [parts[0]]
    add = out.append
    for k, v, part in zip(kinds, vals, parts[1:]):
        if k is str:
            add(_encode_str(v))
        elif k is bool:
            add("true" if v else "false")
        elif k is int:
            add('"' + int.__repr__(v) + '"')
        else:  # float: its repr (digits, sign, point, exponent, inf, nan)
            add('"' + v + '"')
        add(part)
    return "".join(out)


def _tree_fits(p: Probe, tree: Any) -> Optional[List[Any]]:
    """Whether skeleton ``tree`` (what flatten read) is what probe ``p``'s tokens, values and
    metadata give, node for node: the container types and keys (and so every name), the
    plain values, each tensor's dtype and Parameter flags, each array's dtype. A state
    changed while it was flattened is not cached (every cached name and value is then a
    function of the key). Returns the tree's plain nodes with a value, in order (the
    probe's ``vals``), or None when it does not fit."""
    assert p.sig is not None
    meta, params = p.sig[0], p.sig[8]
    toks, vals = p.tokens, p.vals
    slots: List[Any] = []
    at = 0  # next token
    nt = 0  # next tensor (index into the metadata)

    def node(n: Any) -> bool:
        nonlocal at, nt
        if at >= len(toks):
            return False
        tok = toks[at]
        at += 1
        t = n["t"]
        if tok is _T or tok is _P:
            if t != "tensor" or nt >= len(meta):
                return False
            m = meta[nt]
            param = tok is _P or params[nt]
            nt += 1
            if n.get("dtype") != _state.torch_dtype_name(m[3]) or n.get("param", False) != param:
                return False
            return not param or n.get("requires_grad") == bool(m[4])
        if tok is None:
            return t == "none"
        if tok is int or tok is float or tok is str or tok is bool:
            i = len(slots)
            if i >= len(vals) or t != tok.__name__:
                return False
            v, nv = vals[i], n["v"]
            slots.append(n)
            if tok is int:  # the tree holds str(v): a number of at most the digits str allows
                return type(nv) is str and nv == _int_str(v)
            if tok is bool:
                return nv is v
            return type(nv) is str and nv == v  # a float by its repr, "inf" and "nan" alike
        typ, v = tok
        if typ is dict or typ is _OD:
            if t != ("odict" if typ is _OD else "dict") or len(n["v"]) != len(v):
                return False
            for (kind, k, child), key in zip(n["v"], v):
                if kind != ("s" if type(key) is str else "i") or k != str(key) or not node(child):
                    return False
            return True
        if typ is list or typ is tuple:
            return t == typ.__name__ and len(n["v"]) == v and all(node(c) for c in n["v"])
        if typ is _ND:
            return t == "ndarray" and n["dtype"] == _state.little_endian(v).str
        return False

    if node(tree) and at == len(toks) and nt == len(meta) and len(slots) == len(vals):
        return slots
    return None


def _int_str(v: int) -> Optional[str]:
    """``str(v)``, or None for an int with more digits than ``str`` converts."""
    try:
        return int.__repr__(v)
    except ValueError:
        return None


def _holdable(p: Probe, infos: Sequence[Tuple[Any, ...]]) -> bool:
    """:func:`holdable` of the leaves ``infos`` (a layout's) as probe ``p``'s metadata
    describes them (not as they read later)."""
    assert p.sig is not None
    meta, shapes, strides, conj, neg = p.sig[0], p.sig[1], p.sig[2], p.sig[5], p.sig[6]
    pos = range(len(infos)) if p.tensor_pos is None else p.tensor_pos
    for j, i in enumerate(pos):
        device, shape = meta[j][2], shapes[j]
        if infos[i][3] is not None or device.type == "cpu":
            continue  # an alias, a host tensor
        if conj[j] or neg[j] or (math.prod(shape) and not _contiguous(shape, strides[j])):
            return False
    return True


def fits(
    p: Probe, lay: "Layout", entries: Sequence[Any], own: Sequence[Tuple[int, int]], devices: Sequence[int]
) -> bool:
    """Whether each engine tuple ``entries[e]`` that ``save`` took from the own memory of
    leaf ``i`` (``own``: ``(e, i)``) is what probe ``p``'s metadata gives that tensor: a
    contiguous tensor, not a lazy view, of that shape, length and device, its memory the
    leaf's (an empty one: no memory, host), and ``devices`` the CUDA ordinals of layout
    ``lay``'s stored tensors. A tuple captured from other metadata (the state changed during
    the save and back) is never cached: a plan's tuples are always the compared ones."""
    assert p.sig is not None
    meta, shapes, strides, _, ptrs, conj, neg, _, _ = p.sig
    pos = None if p.tensor_pos is None else {i: j for j, i in enumerate(p.tensor_pos)}
    cuda = {
        m[2].index
        for m, i in zip(meta, range(len(meta)) if p.tensor_pos is None else p.tensor_pos)
        if m[2].type == "cuda" and lay.infos[i][3] is None
    }
    if sorted(cuda) != list(devices):
        return False
    for e, i in own:
        j = i if pos is None else pos.get(i)
        if j is None:
            return False
        device, dtype, shape = meta[j][2], meta[j][3], shapes[j]
        n = math.prod(shape)
        nbytes = n * dtype.itemsize
        if n and (conj[j] or neg[j] or not _contiguous(shape, strides[j])):
            return False
        dev = -1 if not nbytes or device.type == "cpu" else device.index
        en = entries[e]
        if (en[2], en[4], en[5]) != (list(shape), nbytes, dev):
            return False
        mem = en[3]
        if nbytes and (mem is None or mem.data_ptr() != ptrs[j]):
            return False
    return True


def _contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """``Tensor.is_contiguous()`` of a non-empty tensor of this shape and these strides."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def holdable(leaves: Sequence[Leaf]) -> bool:
    """Whether every leaf is an alias, an array, a host tensor or contiguous and not a
    conjugate or negative view: a non-blocking save with no guard can then hold the
    trainer's streams (``save``). A lazy CUDA view is captured by a pinned copy of its
    memory, its bits applied on the host once the copy finished: the held path, which hands
    the engine only tensors it copies itself, cannot take it."""
    return all(
        lf.alias_of is not None
        or lf.kind == "ndarray"
        or lf.obj.is_cpu
        or (not lf.lazy and lf.obj.is_contiguous())
        for lf in leaves
    )


def membership(
    p: Optional[Probe], leaves: Optional[Sequence[Leaf]], guarded: Set[Any], key: Any
) -> List[bool]:
    """For each leaf: whether its memory is in ``guarded`` (storage keys); arrays are not.
    From the probe's storages when there is one, else ``key(tensor)`` of each of
    ``leaves``."""
    if p is not None and p.sig is not None:
        keys = p.storage_keys()
        # All inside (what a deferred save needs): one set operation; else each key.
        inside = [True] * len(keys) if guarded.issuperset(keys) else list(map(guarded.__contains__, keys))
        if p.tensor_pos is None:
            return inside
        out = [False] * len(p.objs)
        for i, v in zip(p.tensor_pos, inside):
            out[i] = v
        return out
    assert leaves is not None
    return [lf.kind != "ndarray" and key(lf.obj) in guarded for lf in leaves]


def guard_keys(tensors: List[Any], key: Any) -> Set[Tuple[Any, int]]:
    """The storage keys (``_util._storage_key``) of ``tensors``: plain tensors and
    Parameters at once, others (DTensors: their local shard) one by one."""
    plain = [t for t in tensors if type(t) is _T or type(t) is _P]
    out: Set[Tuple[Any, int]] = set(
        zip(map(operator.attrgetter("device"), plain), map(_STORAGE.data_ptr, map(_T.untyped_storage, plain)))
    )
    if len(plain) != len(tensors):
        out.update(key(t) for t in tensors if not (type(t) is _T or type(t) is _P))
    return out

