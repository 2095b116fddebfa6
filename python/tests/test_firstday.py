"""What a new user meets first: a missing root, a state larger than the first arena,
``help()``, ``load_into`` of only the model, ``shmckpt inspect``'s creation date."""

import errno
import inspect
import os
import pydoc
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import shmckpt
import shmckpt.dcp
from conftest import REPO, shmckpt_bin

MIB = 1 << 20


def raw(t):
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def randbytes(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (n // 4,), dtype=torch.int32, generator=g)


# -- the root --------------------------------------------------------------------------


def test_missing_root_and_parents_are_created(tmp_path):
    root = tmp_path / "runs" / "a" / "b"
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=8 * MIB, chunk_size=MIB)) as ck:
        assert root.is_dir()
        ck.save(1, {"w": torch.arange(6.0)}).wait()
        assert raw(ck.load(1)["w"]) == raw(torch.arange(6.0))
    # An existing root is used as it is.
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=8 * MIB, chunk_size=MIB)) as ck:
        assert ck.list() == [1]


def test_root_that_cannot_be_created_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(shmckpt.RootCreateFailed) as ei:
        shmckpt.Checkpointer(f / "sub", tuning=shmckpt.Tuning(staging_capacity=8 * MIB, chunk_size=MIB))
    e = ei.value
    assert isinstance(e, shmckpt.RootMissing) and isinstance(e, shmckpt.ShmckptError)
    assert e.kind == "RootCreateFailed" and e.errno_code == errno.ENOTDIR
    assert str(e).startswith(f"cannot create checkpoint root {f / 'sub'}: "), str(e)
    # A file where the root should be.
    with pytest.raises(shmckpt.RootCreateFailed) as ei:
        shmckpt.Checkpointer(f, tuning=shmckpt.Tuning(staging_capacity=8 * MIB, chunk_size=MIB))
    assert ei.value.errno_code == errno.EEXIST
    assert f.read_bytes() == b"x" and sorted(os.listdir(tmp_path)) == ["file"]


# -- staging sized from the saves ------------------------------------------------------


def expected_capacity(file_bytes, chunk):
    needed = -(-file_bytes // chunk) * chunk
    return -(-(needed + needed // 16) // chunk) * chunk


def test_staging_capacity_sizes_itself_from_the_saves(root):
    chunk = MIB
    ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(chunk_size=chunk))
    try:
        assert ck.staging_capacity == 64 * MIB  # the first arena
        small = {"w": randbytes(4 * MIB, 0)}
        ck.save(1, small).wait()
        assert ck.staging_capacity == 64 * MIB  # fits: no resize
        big = {"model": {"a": randbytes(48 * MIB, 1), "b": randbytes(32 * MIB, 2)}, "step": 2}
        h = ck.save(2, big)  # 80 MiB > 64 MiB: the engine is reopened with a larger arena
        h.wait()
        f2 = root / "step-2" / "rank-00000-of-00001.safetensors"
        cap2 = expected_capacity(f2.stat().st_size, chunk)
        assert ck.staging_capacity == cap2 and cap2 == 87 * MIB  # 81 MiB + 1/16, in whole chunks
        # A larger save while one is still in flight (non-blocking): the one in flight is
        # committed first, then the arena grows again.
        bigger = {"model": {"a": randbytes(48 * MIB, 3), "b": randbytes(48 * MIB, 4)}, "step": 3}
        h3 = ck.save(3, big | {"step": 3}, blocking=False)
        h4 = ck.save(4, bigger, blocking=False)
        h3.wait()
        h4.wait()
        f4 = root / "step-4" / "rank-00000-of-00001.safetensors"
        assert ck.staging_capacity == expected_capacity(f4.stat().st_size, chunk)
        # A smaller save does not shrink it.
        ck.save(5, small).wait()
        assert ck.staging_capacity == expected_capacity(f4.stat().st_size, chunk)
        assert ck.list() == [1, 2, 3, 4, 5]
        for step, state in ((1, small), (2, big), (4, bigger), (5, small)):
            back = ck.load(step)
            flat_a, flat_b = shmckpt.flatten(state), shmckpt.flatten(back)
            assert [lf.name for lf in flat_a.leaves] == [lf.name for lf in flat_b.leaves]
            for x, y in zip(flat_a.leaves, flat_b.leaves):
                assert raw(x.obj) == raw(y.obj), (step, x.name)
        assert ck.load(3)["step"] == 3 and raw(ck.load(3)["model"]["a"]) == raw(big["model"]["a"])
    finally:
        ck.close()


def test_an_explicit_staging_capacity_does_not_grow(root):
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=8 * MIB, chunk_size=MIB)) as ck:
        with pytest.raises(shmckpt.TooLarge, match="raise staging_capacity"):
            ck.save(1, {"w": randbytes(9 * MIB, 0)})
        assert ck.staging_capacity == 8 * MIB and ck.list() == []


CHILD_SMALL_SHM = textwrap.dedent(
    """
    import os, sys, torch, shmckpt
    assert os.listdir("/dev/shm") == []
    root = sys.argv[1]
    ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(chunk_size=1 << 20))   # a 64 MiB arena in a 80 MiB tmpfs
    try:
        ck.save(1, {"w": torch.zeros(100 << 18)})          # needs 100 MiB of staging
    except shmckpt.ShmTooSmall as e:
        print("ERROR:", e)
    else:
        raise SystemExit("no error")
    # The engine was not touched: the arena is the same and a save that fits works.
    assert ck.staging_capacity == 64 << 20
    ck.save(2, {"w": torch.arange(10.0)}).wait()
    assert torch.equal(ck.load(2)["w"], torch.arange(10.0))
    ck.close()
    assert os.listdir("/dev/shm") == []
    print("CHILD-DONE")
    """
)


def test_staging_larger_than_dev_shm_is_a_clear_error(root):
    """In a private mount namespace with an 80 MiB tmpfs on /dev/shm (never the host's)."""
    unshare = shutil.which("unshare")
    script = (
        "mount -t tmpfs -o size=80m tmpfs /dev/shm && exec \"$0\" -c \"$1\" \"$2\""
    )
    cmd = [unshare, "-m", "--propagation", "private", "sh", "-c", script,
           sys.executable, CHILD_SMALL_SHM, str(root)] if unshare else None
    probe = subprocess.run(
        [unshare, "-m", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True
    ) if unshare else None
    if probe is None or probe.returncode != 0:
        if os.environ.get("SHMCKPT_REQUIRE_NS") == "1":
            pytest.fail("SHMCKPT_REQUIRE_NS=1 but no private mount namespace is available")
        pytest.skip("needs unshare -m and mount (root); SHMCKPT_REQUIRE_NS=1 makes this a failure")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "CHILD-DONE" in out.stdout, out.stdout + out.stderr
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("ERROR:")][0]
    m = re.search(r"cannot hold (\d+) bytes \(free in /dev/shm: (\d+) bytes\)", line)
    assert m, line
    requested, available = int(m.group(1)), int(m.group(2))
    assert requested == 101 * MIB  # 100 MiB and the header, in whole 1 MiB chunks
    assert 64 * MIB <= available < 80 * MIB  # the free bytes plus the arena it replaces
    assert "staging_capacity" in line and "enlarge /dev/shm" in line, line


# -- load_into of the sub-trees the target names ---------------------------------------


def test_load_into_compares_only_the_subtrees_the_target_names(ck):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched.step()
    ck.save(7, {
        "model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
        "rng": {"cpu": torch.get_rng_state()}, "step": 7, "scale": torch.tensor(2.0),
    }).wait()
    torch.manual_seed(1)
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    # Top-level tensors are always compared: "scale" is unexpected unless given.
    with pytest.raises(shmckpt.DestinationError) as ei:
        ck.load_into({"model": m2.state_dict()})
    assert "1 problem(s)" in str(ei.value) and "scale: in the checkpoint, not in the destination" in str(ei.value)
    r = ck.load_into({"model": m2.state_dict(), "scale": torch.zeros(())})
    assert r.step == 7 and r.missing_keys == [] and r.unexpected_keys == []
    for k, v in model.state_dict().items():
        assert raw(m2.state_dict()[k]) == raw(v), k
    # Inside a named sub-tree, strict stays exact: a missing and an extra model key.
    sd = m2.state_dict()
    del sd["1.running_var"]
    sd["extra"] = torch.zeros(1)
    with pytest.raises(shmckpt.DestinationError) as ei:
        ck.load_into({"model": sd, "scale": torch.zeros(())})
    msg = str(ei.value)
    assert "(2 problem(s))" in msg
    assert "model.extra: in the destination, not in the checkpoint" in msg
    assert "model.1.running_var: in the checkpoint, not in the destination" in msg
    assert "optim" not in msg and "rng" not in msg
    r = ck.load_into({"model": sd, "scale": torch.zeros(())}, strict=False)
    assert r.missing_keys == ["model.extra"] and r.unexpected_keys == ["model.1.running_var"]
    # Naming optim too compares it: an optimizer without state misses every state tensor.
    o3 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    with pytest.raises(shmckpt.DestinationError, match="optim.state.0.exp_avg: in the checkpoint"):
        ck.load_into({"model": m2.state_dict(), "optim": o3.state_dict(), "scale": torch.zeros(())})


def test_load_into_a_flat_state_dict_stays_fully_strict(ck):
    ck.save(1, {"a": torch.ones(2), "b": torch.ones(3)}).wait()
    with pytest.raises(shmckpt.DestinationError, match="b: in the checkpoint, not in the destination"):
        ck.load_into({"a": torch.zeros(2)})


# -- help() ---------------------------------------------------------------------------


def public_objects():
    import shmckpt.errors as errors

    import shmckpt.lightning as lightning_io  # lightning is installed by scripts/test.sh

    mods = [("shmckpt", shmckpt), ("shmckpt.errors", errors), ("shmckpt.dcp", shmckpt.dcp),
            ("shmckpt.lightning", lightning_io)]
    out = []
    for modname, mod in mods:
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                out.append((f"{modname}.{name}", obj))
                if inspect.isclass(obj) and not issubclass(obj, BaseException):
                    # The class and its shmckpt bases (Checkpointer's methods live in mixins).
                    seen = set()
                    for klass in obj.__mro__:
                        if not klass.__module__.startswith("shmckpt"):
                            continue
                        for mname, m in vars(klass).items():
                            if mname in seen:
                                continue
                            seen.add(mname)
                            if isinstance(m, (classmethod, staticmethod)):
                                m = m.__func__
                            if not mname.startswith("_") and (inspect.isfunction(m) or isinstance(m, property)):
                                out.append((f"{modname}.{name}.{mname}", m))
    return out


def test_help_shows_a_docstring_for_every_public_class_and_function():
    objs = public_objects()
    assert len(objs) > 40
    missing = []
    for qual, obj in objs:
        doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj)
        text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
        if not doc or doc.split("\n")[0] not in text:
            missing.append(qual)
    assert missing == [], f"no docstring in help(): {missing}"


# -- shmckpt inspect ------------------------------------------------------------------


def test_inspect_prints_the_creation_date(ck, root):
    exe = shmckpt_bin()
    assert exe, "the shmckpt binary is missing: run `cargo build` or set SHMCKPT_BIN"
    ck.save(3, {"w": torch.ones(2)}).wait()
    created = ck.manifest(3)["created_unix_ms"]
    out = subprocess.run([exe, "inspect", str(root / "step-3")], capture_output=True, text=True, check=True)
    import datetime

    when = datetime.datetime.fromtimestamp(created / 1000, datetime.timezone.utc)
    want = when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{created % 1000:03d}Z"
    assert f"  created     {want}\n" in out.stdout, out.stdout
    assert "since epoch" not in out.stdout
