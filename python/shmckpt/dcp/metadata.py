"""Reading DCP's ``.metadata`` (a pickle) without letting it change this process.

Restricting which globals a pickle may name (``find_class``) is not enough: pickle's
``BUILD`` opcode sets attributes on whatever object is on the stack, and an allowed
*class* is such an object, so a crafted ``.metadata`` could set
``pathlib.PurePosixPath.__truediv__`` for the whole process. This unpickler is the pure
Python ``pickle._Unpickler`` (its opcode table is a Python dict, so no C fast path can
bypass it) with a table of its own that holds only the opcodes DCP's metadata needs:

* globals: exactly the classes of ``torch.distributed.checkpoint.metadata`` (its
  dataclasses and ``_MEM_FORMAT_ENCODING``), DCP's ``_StorageInfo``, the storage classes
  the caller adds (``ShmckptStorageInfo``), ``torch.Size``, torch's dtypes,
  ``torch.serialization._get_layout`` and ``pathlib``'s ``PosixPath``/``PurePosixPath``
  (the ``checkpoint_id`` of a ``FileSystemWriter`` checkpoint);
* ``NEWOBJ``/``NEWOBJ_EX``: only of those dataclasses, without arguments;
* ``REDUCE``: only ``torch.Size`` (a sequence of ints), ``_get_layout`` (a layout's name),
  ``_MEM_FORMAT_ENCODING`` (an int) and the path classes (strings);
* ``BUILD``: only on a dataclass instance this unpickler made (never a class, a global or
  a ``REDUCE`` result), with a dict of that dataclass's field names (a tuple of the
  expected types for ``TensorProperties``, through its own ``__setstate__``, looked up on
  the class, never on the instance);
* ``SETITEM(S)``/``APPEND(S)``/``ADDITEMS``: only on a dict, list or set this unpickler
  made;
* no ``INST``/``OBJ`` (protocol 0/1 instantiation), persistent ids, extension registry
  codes or out-of-band buffers.

Anything else is a :class:`~shmckpt.errors.CorruptError` naming the path and the refused
opcode or global; the loaded object is then checked to have Metadata's structure.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickle
from typing import Any, Callable, ClassVar, Dict, FrozenSet, Iterable, List, Tuple

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from .._util import _gc_paused
from ..errors import CorruptError

__all__ = ["load_metadata", "MAX_METADATA_BYTES"]

#: Largest ``.metadata`` this reader accepts.
MAX_METADATA_BYTES = 1 << 30

_P = pickle._Unpickler  # type: ignore[attr-defined]


class _Refused(Exception):
    """A refused opcode or global (becomes a CorruptError naming the path)."""


def _ints(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and all(type(i) is int for i in x)


class _Rules:
    """What a DCP ``.metadata`` may contain, for the installed torch."""

    def __init__(self, storage_classes: Iterable[type]):
        classes = [getattr(_md, n) for n in _md.__all__] + [_StorageInfo, *storage_classes]
        #: dataclass -> its field names (what BUILD may set)
        self.fields: Dict[type, FrozenSet[str]] = {
            c: frozenset(f.name for f in dataclasses.fields(c)) for c in classes if isinstance(c, type) and dataclasses.is_dataclass(c)
        }
        self.globals: Dict[Tuple[str, str], Any] = {}
        for c in [*self.fields, _md._MEM_FORMAT_ENCODING]:
            self.globals[(c.__module__, c.__qualname__)] = c
        self.globals[("torch", "Size")] = torch.Size
        for name, v in vars(torch).items():
            if isinstance(v, torch.dtype):
                self.globals[("torch", name)] = v
        get_layout = torch.serialization._get_layout
        self.globals[("torch.serialization", "_get_layout")] = get_layout
        for c in (pathlib.PosixPath, pathlib.PurePosixPath):
            self.globals[("pathlib", c.__name__)] = c
            self.globals[(c.__module__, c.__qualname__)] = c
        layouts = {str(v) for v in vars(torch).values() if isinstance(v, torch.layout)}
        enc = _md._MEM_FORMAT_ENCODING
        #: callable -> check of its arguments (REDUCE)
        self.calls: Dict[Any, Callable[[tuple], bool]] = {
            torch.Size: lambda a: len(a) == 1 and _ints(a[0]),
            get_layout: lambda a: len(a) == 1 and type(a[0]) is str and a[0] in layouts,
            enc: lambda a: len(a) == 1 and type(a[0]) is int,
            pathlib.PosixPath: lambda a: all(type(s) is str for s in a),
            pathlib.PurePosixPath: lambda a: all(type(s) is str for s in a),
        }


def _properties_state(state: Any) -> bool:
    """Whether ``state`` is what ``TensorProperties.__getstate__`` makes."""
    if type(state) is not tuple or len(state) not in (5, 6):
        return False
    dtype, layout, grad, enc, pin = state[:5]
    strides = state[5] if len(state) == 6 else None
    return (
        isinstance(dtype, torch.dtype)
        and isinstance(layout, torch.layout)
        and type(grad) is bool
        and isinstance(enc, _md._MEM_FORMAT_ENCODING)
        and type(pin) is bool
        and (strides is None or (type(strides) is tuple and _ints(strides)))
    )


class _MetadataUnpickler(_P):
    """``pickle._Unpickler`` with the opcode table described in the module docstring."""

    dispatch: ClassVar[Dict[int, Callable[[Any], None]]] = {}
    #: pickle._Unpickler's (not in its type stubs): the items above the topmost mark.
    pop_mark: Callable[[], List[Any]]

    def __init__(self, data: bytes, rules: _Rules):
        self._bio = io.BytesIO(data)
        super().__init__(self._bio)
        self._rules = rules
        #: id -> object, for every container and instance this unpickler made (kept
        #: alive here, so an id is never reused during the load).
        self._fresh: Dict[int, Any] = {}

    def _mark(self, obj: Any) -> None:
        self._fresh[id(obj)] = obj

    def _is_fresh(self, obj: Any) -> bool:
        return self._fresh.get(id(obj)) is obj

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._rules.globals[(module, name)]
        except KeyError:
            raise _Refused(f"refuses to load global {module}.{name} (not DCP metadata)") from None

    def load(self) -> Any:
        """``_Unpickler.load`` reading straight from the in-memory file: frames are only
        a buffering hint (their bytes are the next opcodes), so ``FRAME`` skips its length
        and every read is one C call (4x faster than through pickle's unframer)."""
        self.read = self._bio.read
        self.readinto = self._bio.readinto
        self.readline = self._bio.readline
        self.metastack: List[Any] = []
        self.stack: list = []
        self.append = self.stack.append
        self.proto = 0
        read = self.read
        dispatch = self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def load_frame(self) -> None:
        if len(self.read(8)) != 8:
            raise EOFError

    # -- checked opcodes ----------------------------------------------------------------
    def _newobj(self, cls: Any, args: Any, kwargs: Any) -> None:
        if not (type(cls) is type and cls in self._rules.fields) or type(args) is not tuple or len(args) != 0:
            raise _Refused(f"refuses to construct {cls!r} with {args!r}, {kwargs!r} (not DCP metadata)")
        if type(kwargs) is not dict or len(kwargs) != 0:
            raise _Refused(f"refuses to construct {cls!r} with {args!r}, {kwargs!r} (not DCP metadata)")
        new: Any = cls.__new__  # (a dataclass checked above; mypy reads type.__new__)
        obj = new(cls)
        self._mark(obj)
        self.append(obj)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self._newobj(cls, args, {})

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self._newobj(cls, args, kwargs)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        # By identity: nothing from the pickle is hashed or compared here.
        check = next((c for f, c in self._rules.calls.items() if f is func), None)
        if check is None or type(args) is not tuple or not check(args):
            raise _Refused(f"refuses to call {func!r} with {args!r} (not DCP metadata)")
        self.stack[-1] = func(*args)  # never fresh: no BUILD or SETITEM may change it

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        fields = self._rules.fields.get(cls)
        if fields is None or not self._is_fresh(inst):
            raise _Refused(f"refuses to set the state of {inst!r}: only metadata objects it made itself")
        if cls is _md.TensorProperties:
            if not _properties_state(state):
                raise _Refused(f"refuses {state!r} as the state of TensorProperties")
            _md.TensorProperties.__setstate__(inst, state)  # the class's, never the instance's
            return
        if any("__setstate__" in vars(c) for c in cls.__mro__[:-1]):
            # A metadata class of another torch whose state this reader does not know.
            raise _Refused(f"refuses to set the state of {cls.__qualname__}: it has a __setstate__ of its own")
        if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
            raise _Refused(f"refuses {state!r} as the state of {cls.__qualname__} (fields: {sorted(fields)})")
        inst.__dict__.update(state)

    def _target(self, kind: type) -> Any:
        obj = self.stack[-1]
        if type(obj) is not kind or not self._is_fresh(obj):
            raise _Refused(f"refuses to add items to {obj!r}: only a {kind.__name__} it made itself")
        return obj

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._target(dict)[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        d = self._target(dict)
        for i in range(0, len(items), 2):
            d[items[i]] = items[i + 1]

    def load_append(self) -> None:
        value = self.stack.pop()
        self._target(list).append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._target(list).extend(items)

    def load_additems(self) -> None:
        items = self.pop_mark()
        self._target(set).update(items)


def _fresh_after(base: Callable[[Any], None]) -> Callable[[Any], None]:
    def run(self: _MetadataUnpickler) -> None:
        base(self)
        self._mark(self.stack[-1])

    return run


def _build_dispatch() -> None:
    P = pickle
    plain = [
        P.PROTO, P.STOP, P.MARK, P.POP, P.POP_MARK, P.DUP, P.NONE, P.NEWTRUE,
        P.NEWFALSE, P.INT, P.BININT, P.BININT1, P.BININT2, P.LONG, P.LONG1, P.LONG4,
        P.FLOAT, P.BINFLOAT, P.STRING, P.BINSTRING, P.SHORT_BINSTRING, P.BINBYTES,
        P.SHORT_BINBYTES, P.BINBYTES8, P.UNICODE, P.BINUNICODE, P.SHORT_BINUNICODE,
        P.BINUNICODE8, P.EMPTY_TUPLE, P.TUPLE, P.TUPLE1, P.TUPLE2, P.TUPLE3, P.FROZENSET,
        P.GET, P.BINGET, P.LONG_BINGET, P.PUT, P.BINPUT, P.LONG_BINPUT, P.MEMOIZE,
        P.GLOBAL, P.STACK_GLOBAL,
    ]  # fmt: skip
    fresh = [P.EMPTY_DICT, P.DICT, P.EMPTY_LIST, P.LIST, P.EMPTY_SET]
    checked = {
        P.FRAME: _MetadataUnpickler.load_frame,
        P.NEWOBJ: _MetadataUnpickler.load_newobj,
        P.NEWOBJ_EX: _MetadataUnpickler.load_newobj_ex,
        P.REDUCE: _MetadataUnpickler.load_reduce,
        P.BUILD: _MetadataUnpickler.load_build,
        P.SETITEM: _MetadataUnpickler.load_setitem,
        P.SETITEMS: _MetadataUnpickler.load_setitems,
        P.APPEND: _MetadataUnpickler.load_append,
        P.APPENDS: _MetadataUnpickler.load_appends,
        P.ADDITEMS: _MetadataUnpickler.load_additems,
    }
    table: Dict[int, Callable[[Any], None]] = {}
    for op in plain:
        table[op[0]] = _P.dispatch[op[0]]
    for op in fresh:
        table[op[0]] = _fresh_after(_P.dispatch[op[0]])
    for op, fn in checked.items():
        table[op[0]] = fn

    def refuse(self: Any) -> None:
        raise _Refused("refuses an opcode DCP metadata never uses (instantiation, persistent id, extension or buffer)")

    for code in range(256):
        if code not in table:
            table[code] = refuse
    _MetadataUnpickler.dispatch = table


_build_dispatch()


def _check_structure(md: Any, path: str) -> None:
    """Refuse an object that is not shaped like DCP's Metadata (types of its fields)."""

    def bad(what: str) -> CorruptError:
        return CorruptError(f"{path}: not valid DCP metadata ({what})")

    if type(md) is not _md.Metadata:
        raise CorruptError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    sdm = getattr(md, "state_dict_metadata", None)
    if type(sdm) is not dict:
        raise bad("state_dict_metadata is not a dict")
    for fqn, m in sdm.items():
        if type(fqn) is not str:
            raise bad(f"key {fqn!r} is not a string")
        if type(m) is _md.BytesStorageMetadata:
            continue
        if type(m) is not _md.TensorStorageMetadata:
            raise bad(f"{fqn!r} is described by a {type(m).__name__}")
        if type(getattr(m, "properties", None)) is not _md.TensorProperties or not isinstance(
            getattr(m, "size", None), torch.Size
        ):
            raise bad(f"{fqn!r} has no tensor properties or size")
        chunks = getattr(m, "chunks", None)
        if type(chunks) is not list or not all(
            type(c) is _md.ChunkStorageMetadata
            and isinstance(getattr(c, "offsets", None), torch.Size)
            and isinstance(getattr(c, "sizes", None), torch.Size)
            for c in chunks
        ):
            raise bad(f"{fqn!r} has chunks that are not ChunkStorageMetadata")
    sd = getattr(md, "storage_data", None)
    if sd is not None:
        if type(sd) is not dict:
            raise bad("storage_data is not a dict")
        for k in sd:
            if type(k) is not _md.MetadataIndex or type(getattr(k, "fqn", None)) is not str:
                raise bad(f"storage_data key {k!r} is not a MetadataIndex")
            off = getattr(k, "offset", None)
            if off is not None and not isinstance(off, torch.Size):
                raise bad(f"storage_data key {k!r} has an offset that is not a torch.Size")
    sm = getattr(md, "storage_meta", None)
    if sm is not None and type(sm) is not _md.StorageMeta:
        raise bad(f"storage_meta is a {type(sm).__name__}")


def load_metadata(path: str, f: Any, storage_classes: Tuple[type, ...] = ()) -> Any:
    """Unpickle DCP's Metadata from the open file ``f`` (named ``path`` in errors) with
    the rules of the module docstring; ``storage_classes``: further dataclasses that
    ``storage_data`` may hold (e.g. ``ShmckptStorageInfo``)."""
    size = os.fstat(f.fileno()).st_size
    if size > MAX_METADATA_BYTES:
        raise CorruptError(f"{path}: {size} bytes of metadata is more than this reader accepts")
    data = f.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise CorruptError(f"{path}: more metadata than this reader accepts")
    try:
        # No cyclic GC while the objects are made (it would scan the whole heap again and
        # again: most of the time of a load of 1,300 tensors' metadata).
        with _gc_paused():
            md = _MetadataUnpickler(data, _Rules(storage_classes)).load()
    except _Refused as e:
        raise CorruptError(f"{path}: {e}") from None
    except RecursionError:
        raise CorruptError(f"{path}: not valid DCP metadata (nested too deeply)") from None
    except Exception as e:
        raise CorruptError(f"{path}: not valid DCP metadata ({type(e).__name__}: {e})") from e
    _check_structure(md, path)
    return md

