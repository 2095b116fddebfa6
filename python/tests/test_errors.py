"""Exceptions carry the Rust error's fields as attributes (``path``, ``tensor``, ``step``,
``offset``, ``errno_code``, ``kind``), exactly, and keep them through pickling (DCP sends a
rank's exception to the others pickled)."""

import errno
import os
import pickle

import pytest
import torch

import shmckpt
from shmckpt import errors


def saved(ck, root):
    """Step 1 of one int32 tensor ``model.w``; returns the rank file's path."""
    ck.save(1, {"model": {"w": torch.arange(256, dtype=torch.int32)}}).wait()
    name = ck.manifest(1)["files"][0]["file"]
    assert name == "rank-00000-of-00001.safetensors"
    return os.path.join(str(root), "step-1", name)


def fields(e):
    return (e.kind, e.path, e.tensor, e.step, e.offset, e.errno_code)


def test_checksum_error_names_the_file_and_the_tensor(ck, root):
    path = saved(ck, root)
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)  # in model.w's bytes (the last tensor of the file)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(errors.ChecksumError) as ei:
        ck.load(1)
    e = ei.value
    assert fields(e) == ("ChecksumError", path, "model.w", None, None, None)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is errors.ChecksumError and str(back) == str(e)
    assert fields(back) == fields(e)


def test_not_found_names_the_step_and_the_root(ck, root):
    saved(ck, root)
    for call in (lambda: ck.remove(7), lambda: ck.manifest(7), lambda: ck.load(7), lambda: ck.load_into({}, 7)):
        with pytest.raises(errors.NotFound) as ei:
            call()
        assert fields(ei.value) == ("NotFound", str(root), None, 7, None, None), str(ei.value)
    # "latest" of an empty root names no step.
    empty = root / "empty"
    with shmckpt.Checkpointer(empty, tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20)) as ck2:
        with pytest.raises(errors.NotFound) as ei:
            ck2.manifest()
    assert (ei.value.step, ei.value.path) == (None, str(empty))


def test_io_error_names_the_path_and_the_errno(ck, root):
    path = saved(ck, root)
    os.remove(path)
    with pytest.raises(errors.IoError) as ei:
        ck.load(1)
    e = ei.value
    assert fields(e) == ("IoError", path, None, None, None, errno.ENOENT)
    assert isinstance(e, OSError)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is errors.IoError and fields(back) == fields(e)


def test_errors_made_in_python_take_the_fields_and_pickle():
    e = errors.CorruptError("bad", path="/x/step-3/f", tensor="t", step=3, offset=4096)
    assert (e.path, e.tensor, e.step, e.offset, e.errno_code, str(e)) == ("/x/step-3/f", "t", 3, 4096, None, "bad")
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), back.path, back.tensor, back.step, back.offset, str(back)) == (
        errors.CorruptError, "/x/step-3/f", "t", 3, 4096, "bad"
    )
    # Not given: the class defaults (None), nothing in the instance.
    plain = errors.NotFound("none")
    assert (plain.path, plain.tensor, plain.step, plain.offset, plain.__dict__) == (None, None, None, None, {})
    u = errors.UnsupportedValue("no", key="state['a']")
    u.path = "/p"
    back = pickle.loads(pickle.dumps(u))
    assert (type(back), str(back), back.key, back.path) == (errors.UnsupportedValue, "no", "state['a']", "/p")


def test_ctrl_c_while_a_submission_runs_keeps_the_tensors_alive():
    """A KeyboardInterrupt in a wait for a submission still running must not drop the
    references the submitting thread still reads (it did: the handle released them on any
    exception); a submission that failed does release them."""
    import concurrent.futures

    from shmckpt.checkpointer.handle import SaveHandle

    class Interrupted(concurrent.futures.Future):
        def result(self, timeout=None):
            raise KeyboardInterrupt

    keep = [object()]
    h = SaveHandle(1, keep)
    h._future = Interrupted()  # not done: the submission still runs
    with pytest.raises(KeyboardInterrupt):
        h._get_rust()
    assert h._keep is keep

    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(shmckpt.errors.IoError("submission failed"))
    h2 = SaveHandle(2, [object()])
    h2._future = failed
    with pytest.raises(shmckpt.errors.IoError):
        h2._get_rust()
    assert h2._keep is None


@pytest.mark.parametrize("call", ["load", "load_into", "manifest"])
def test_an_unknown_step_string_is_a_value_error_naming_it(ck, root, call):
    """``load("last")`` (a string other than "latest") is a ValueError naming the value
    and the accepted forms, not a TypeError about types; a bool stays a TypeError. The
    same for every call that takes a step (one parser, ``_step_sel``)."""
    saved(ck, root)
    target = {"model": {"w": torch.zeros(256, dtype=torch.int32)}}
    fn = {
        "load": lambda s: ck.load(s),
        "load_into": lambda s: ck.load_into(target, s),
        "manifest": lambda s: ck.manifest(s),
    }[call]
    with pytest.raises(ValueError) as ei:
        fn("last")
    assert type(ei.value) is ValueError
    assert str(ei.value) == "step 'last' is not a step: give an int (a committed step) or 'latest'"
    with pytest.raises(TypeError) as ti:
        fn(True)
    assert str(ti.value) == "step must be an int or 'latest', not bool True"
    assert torch.equal(target["model"]["w"], torch.zeros(256, dtype=torch.int32))  # nothing read
    fn("latest")  # and the accepted forms still work
    fn(1)
