"""DCP's `.metadata` through shmckpt's restricted unpickler (issue 21, item 3): crafted
pickles that name or change anything outside DCP's metadata are refused with
`CorruptError` and leave every class unchanged; real metadata of this torch still loads.
The single-process helpers are `test_dcp.py`'s."""

import os
import pathlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shmckpt import Tuning, errors
from shmckpt.dcp import ShmckptReader, ShmckptStorageInfo, ShmckptWriter

from test_dcp import CHUNK, FAIL, save, state, zeros
from test_dcp import _quiet  # noqa: F401  (the autouse fixture: warnings quiet, engines released)


# -- crafted .metadata: nothing outside DCP's metadata can be named or changed ---------------

_MD = "torch.distributed.checkpoint.metadata"


def _g(module, name):
    """GLOBAL opcode."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _s(text):
    """SHORT_BINUNICODE opcode."""
    b = text.encode()
    return b"\x8c" + bytes([len(b)]) + b


#: Crafted pickles, each one step of an attack on the loading process (opcodes: N None,
#: } empty dict, s SETITEM, \x86 TUPLE2, b BUILD, ) empty tuple, \x81 NEWOBJ, R REDUCE,
#: K BININT1, \x85 TUPLE1, a APPEND, ] empty list).
CRAFTED = {
    # BUILD on an allowed class: setattr on the class, for the whole process.
    "build_slots_on_a_class": _g("pathlib", "PurePosixPath") + b"N}" + _s("__truediv__") + _g("torch", "Size") + b"s\x86b.",
    "build_dict_on_a_class": _g(_MD, "Metadata") + b"}" + _s("__eq__") + _g("torch", "Size") + b"sb.",
    # BUILD on a shared object a REDUCE returned (an enum member) or a global (a dtype).
    "build_on_an_enum_member": _g(_MD, "_MEM_FORMAT_ENCODING") + b"K\x00\x85RN}" + _s("_value_") + b"K\x07s\x86b.",
    "build_on_a_dtype": _g("torch", "float32") + b"N}" + _s("is_signed") + b"K\x07s\x86b.",
    # BUILD that swaps a fresh object's class, or plants __setstate__ for a second BUILD.
    "build_swaps_the_class": _g(_MD, "TensorStorageMetadata") + b")\x81N}" + _s("__class__") + _g(_MD, "Metadata") + b"s\x86b.",
    "setstate_planted_in_the_instance": _g(_MD, "TensorStorageMetadata") + b")\x81}" + _s("__setstate__")
    + _g("pathlib", "PurePosixPath") + b"sb" + _s("x") + b"b.",
    "setstate_of_properties_with_a_dict": _g(_MD, "TensorProperties") + b")\x81}b.",
    # REDUCE of allowed classes with hostile arguments.
    "reduce_of_a_dataclass": _g(_MD, "Metadata") + b"}\x85R.",
    "newobj_with_arguments": _g(_MD, "Metadata") + _s("x") + b"\x85\x81.",
    "reduce_enum_functional_api": _g(_MD, "_MEM_FORMAT_ENCODING") + _s("X") + _s("a b") + b"\x86R.",
    "reduce_size_of_strings": _g("torch", "Size") + b"]" + _s("x") + b"a\x85R.",
    "reduce_layout_by_odd_name": _g("torch.serialization", "_get_layout") + _s("__class__") + b"\x85R.",
    # Persistent ids, extension codes, protocol 0/1 instantiation.
    "persistent_id": b"P0\n.",
    "binary_persistent_id": _s("x") + b"Q.",
    "extension_code": b"\x82\x01.",
    "inst": b"(ipathlib\nPurePosixPath\n.",
    "obj": b"(" + _g("pathlib", "PurePosixPath") + b"o.",
    # Adding items to objects it did not make.
    "setitem_on_a_class": _g(_MD, "Metadata") + _s("k") + _s("v") + b"s.",
    "append_to_a_reduce_result": _g("pathlib", "PurePosixPath") + _s("a") + b"\x85R" + _s("v") + b"a.",
    # A global outside the allow-list.
    "a_function_of_an_allowed_module": _g("torch.distributed.checkpoint.filesystem", "_write_files_from_queue") + b".",
}


def _process_state():
    """Every attribute of every class (and enum member) a DCP .metadata may name, and
    their neighbours: (repr -> {name: value}), compared by identity."""
    import enum

    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    objs = [pathlib.PurePath, pathlib.PurePosixPath, pathlib.PosixPath, pathlib.Path, torch.Size, _StorageInfo]
    objs += [ShmckptStorageInfo, m._MEM_FORMAT_ENCODING, *list(m._MEM_FORMAT_ENCODING), enum.Enum]
    objs += [getattr(m, n) for n in m.__all__]
    return {repr(o): dict(vars(o)) for o in objs}


def _same_state(before, after):
    assert before.keys() == after.keys()
    for k in before:
        changed = sorted(n for n in before[k].keys() | after[k].keys() if before[k].get(n, ...) is not after[k].get(n, ...))
        assert not changed, f"{k}: {changed} changed"


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_metadata_is_refused_and_changes_nothing(tmp_path, name):
    p = tmp_path / "c"
    p.mkdir()
    (p / ".metadata").write_bytes(b"\x80\x04" + CRAFTED[name])
    before = _process_state()
    try:
        with pytest.raises(errors.CorruptError) as ei:
            ShmckptReader(p).read_metadata()
        assert "refuses" in str(ei.value), str(ei.value)
        assert str(p / ".metadata") in str(ei.value)
        _same_state(before, _process_state())
        assert pathlib.PurePosixPath("a") / "b" == pathlib.PurePosixPath("a/b")
        assert torch.float32.is_signed
    finally:
        # Undo an attack that worked (before the fix), so the other tests are not hit.
        for cls in (pathlib.PurePosixPath,):
            if "__truediv__" in vars(cls):
                delattr(cls, "__truediv__")


def test_a_refused_metadata_leaves_dcps_own_writer_working(tmp_path, monkeypatch):
    """The issue's attack: a .metadata that set PurePosixPath.__truediv__ made DCP's own
    FileSystemWriter write elsewhere. After the refused load, a dcp.save with it writes
    exactly where it should, and nothing lands in the working directory."""
    p = tmp_path / "c"
    save(p)
    (p / ".metadata").write_bytes(b"\x80\x04" + CRAFTED["build_slots_on_a_class"])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    try:
        with pytest.raises(FAIL) as ei:
            dcp.load(zeros(), storage_reader=ShmckptReader(p))
        # (DCP reports a failed read_metadata as "metadata is None; global metadata read
        # failed: <the CorruptError>".)
        assert "refuses to set the state of <class 'pathlib.PurePosixPath'>" in str(ei.value)
        assert "__truediv__" not in vars(pathlib.PurePosixPath)
        out = tmp_path / "fs"
        dcp.save(state(), storage_writer=dcp.FileSystemWriter(str(out)))
        assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp"]
        assert os.listdir(cwd) == []
        dst = zeros()
        dcp.load(dst, storage_reader=dcp.FileSystemReader(str(out)))
        assert torch.equal(dst["w"], state()["w"])
    finally:
        if "__truediv__" in vars(pathlib.PurePosixPath):
            delattr(pathlib.PurePosixPath, "__truediv__")


def test_real_dcp_metadata_of_this_torch_still_loads(tmp_path):
    """What DCP writes (FileSystemWriter: _StorageInfo, a PosixPath checkpoint id,
    planner data) and what ShmckptWriter writes load through the restricted unpickler to
    exactly what pickle itself loads."""
    from shmckpt.dcp.reader import _load_metadata

    st = state()
    st["nested"] = {"cl": torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last), "i": torch.arange(5)}
    st["empty"] = torch.empty(0, 3)
    dcp.save(st, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")))
    dcp.save(st, storage_writer=ShmckptWriter(tmp_path / "shm", tuning=Tuning(chunk_size=CHUNK)))
    for name in ("fs", "shm"):
        f = tmp_path / name / ".metadata"
        with open(f, "rb") as fh:
            want = pickle.load(fh)
        got = _load_metadata(str(f))
        assert got == want, name
        assert got.storage_data == want.storage_data and len(got.storage_data) == 7, name
        assert got.planner_data == want.planner_data and got.planner_data, name
