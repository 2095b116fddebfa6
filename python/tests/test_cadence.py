"""A cadence per tier (issue 38, item 1): ``disk_every`` sends every N-th save (or, with
``"auto"``, every save the disk can take) to disk; the others are memory-only, loadable in
the process, recovered after a SIGKILL, written to disk by ``close()``."""

import json
import subprocess
import sys

import pytest
import torch

import shmckpt
from shmckpt.errors import ConfigError

from conftest import SMALL
import zygote


def state(step, n=1 << 16):
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "w": torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g),
        "b": torch.randn(333, generator=g).to(torch.bfloat16),
        "step": step,
    }


def assert_state(got, step, n=1 << 16):
    want = state(step, n)
    assert got["step"] == step
    assert got["w"].dtype == torch.int32 and torch.equal(got["w"], want["w"])
    assert got["b"].dtype == torch.bfloat16 and torch.equal(got["b"].view(torch.int16), want["b"].view(torch.int16))


def opened(root, **kw):
    return shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20), **kw)


def save(ck, step, **kw):
    s = state(step, **kw)
    rep = ck.save(step, s).wait()
    s["w"].fill_(7)  # the engine holds its own copy
    return rep


def test_every_third_save_goes_to_disk_and_the_rest_is_served_from_memory(root):
    ck = opened(root, cadence=shmckpt.Cadence(disk_every=3))
    r1 = save(ck, 1)
    assert (r1["memory_only"], r1["tiers"]) == (False, ["disk"]) and r1["dir"] is not None
    r2 = save(ck, 2)
    assert (r2["memory_only"], r2["tiers"], r2["dir"], r2["committed"]) == (True, ["memory"], None, None)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-1"]
    assert ck.list(tiers=True) == [(1, ["disk"]), (2, ["memory"])]
    assert ck.latest() == 2
    assert_state(ck.load("latest"), 2)
    assert ck.last_load_source == ("memory", None)
    m = ck.manifest()
    assert (m["step"], len(m["files"]), m["files"][0]["rank"]) == (2, 1, 0), m
    assert_state(ck.load(1), 1)
    assert ck.last_load_source[0] == "disk"

    assert save(ck, 3)["memory_only"]
    assert ck.list() == [1, 3]
    assert_state(ck.load(), 3)
    assert ck.last_load_source == ("memory", None)

    r4 = save(ck, 4)
    assert not r4["memory_only"]
    assert ck.list(tiers=True) == [(1, ["disk"]), (4, ["disk"])]
    assert_state(ck.load(), 4)
    assert ck.last_load_source[0] == "disk"

    # close() writes the newest memory-only step to disk.
    assert save(ck, 5)["memory_only"]
    ck.flush()  # flush leaves it in memory
    assert not (root / "step-5").exists()
    ck.close()
    with opened(root) as again:
        assert again.recovered == []
        assert again.list(tiers=True) == [(1, ["disk"]), (4, ["disk"]), (5, ["disk"])]
        assert_state(again.load("latest"), 5)
        assert again.last_load_source[0] == "disk"


def test_the_default_sends_every_save_to_disk(root):
    with opened(root) as ck:
        for s in (1, 2):
            r = save(ck, s)
            assert (r["memory_only"], r["tiers"]) == (False, ["disk"]) and r["dir"] is not None
        assert ck.list(tiers=True) == [(1, ["disk"]), (2, ["disk"])]


def test_auto_skips_the_disk_while_a_large_save_drains(root):
    n = 32 << 20  # 128 MiB of int32: one writer, one request in flight
    with shmckpt.Checkpointer(
        root,
        tuning=shmckpt.Tuning(staging_capacity=512 << 20, chunk_size=1 << 20, writer_threads=1, queue_depth=1),
        cadence=shmckpt.Cadence(disk_every="auto"),
    ) as ck:
        h1 = ck.save(1, state(1, n))
        h2 = ck.save(2, state(2))
        busy = not h1.done()
        r2 = h2.wait()
        if not busy:
            pytest.skip("the disk took 128 MiB before the next save started: the cadence was not exercised")
        # Step 1 was still draining when step 2 was decided: step 2 stays in memory.
        assert r2["memory_only"], r2
        r1 = h1.wait()
        assert not r1["memory_only"]
        assert ck.list(tiers=True) == [(1, ["disk"]), (2, ["memory"])]
        # The disk is idle: the next save goes to disk.
        r3 = save(ck, 3)
        assert not r3["memory_only"], r3
        assert ck.list(tiers=True) == [(1, ["disk"]), (3, ["disk"])]
        assert_state(ck.load(), 3)


_KILLED_CHILD = (
    "import json, os, signal, sys\n"
    "sys.path.insert(0, sys.argv[2])\n"
    "import shmckpt, test_cadence as t\n"
    "ck = shmckpt.Checkpointer(sys.argv[1], cadence=shmckpt.Cadence(disk_every=2),\n"
    "    tuning=shmckpt.Tuning(staging_capacity=32 << 20, chunk_size=1 << 20))\n"
    "r1 = ck.save(1, t.state(1)).wait()\n"
    "r2 = ck.save(2, t.state(2)).wait()\n"
    "print(json.dumps({'r1': r1['memory_only'], 'r2': r2['memory_only'], 'list': ck.list(tiers=True)}), flush=True)\n"
    "os.kill(os.getpid(), signal.SIGKILL)\n"
)


def test_a_memory_only_step_is_recovered_after_sigkill(root):
    here = str(__import__("pathlib").Path(__file__).resolve().parent)
    p = zygote.run([sys.executable, "-c", _KILLED_CHILD, str(root), here], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    seen = json.loads(p.stdout.splitlines()[0])
    assert seen == {"r1": False, "r2": True, "list": [[1, ["disk"]], [2, ["memory"]]]}, seen
    assert not (root / "step-2").exists()
    with opened(root) as ck:
        assert ck.recovered == [2]
        # Where the open went: the recovery of step 2 (a write, fdatasync and commit) is
        # inside it, and the phases are parts of the whole.
        ph = ck.open_timings
        assert list(ph) == ["recovery", "clean", "arena", "writers", "total"], ph
        assert ph["recovery"] > 0 and all(v >= 0 for v in ph.values()), ph
        assert ph["recovery"] + ph["clean"] + ph["arena"] + ph["writers"] <= ph["total"], ph
        assert ck.list(tiers=True) == [(1, ["disk"]), (2, ["disk"])]
        assert_state(ck.load("latest"), 2)
        assert ck.last_load_source[0] == "disk"


def test_bad_cadences_are_refused(root):
    for bad in (0, -1, "sometimes"):
        with pytest.raises(ValueError):
            opened(root, cadence=shmckpt.Cadence(disk_every=bad))
    with pytest.raises(ConfigError):
        opened(root, cadence=shmckpt.Cadence(disk_every="auto"), rank=0, world_size=2)
    with pytest.raises(ConfigError):
        opened(root, cadence=shmckpt.Cadence(disk_interval_s=5.0), rank=0, world_size=2)


_KILLED_KEEP_CHILD = (
    "import json, os, signal, sys\n"
    "sys.path.insert(0, sys.argv[2])\n"
    "import shmckpt, test_cadence as t\n"
    "ck = shmckpt.Checkpointer(sys.argv[1], keep_in_memory=True, cadence=shmckpt.Cadence(disk_every=10),\n"
    "    tuning=shmckpt.Tuning(staging_capacity=32 << 20, chunk_size=1 << 20))\n"
    "mem = [ck.save(s, t.state(s)).wait()['memory_only'] for s in (1, 2, 3)]\n"
    "print(json.dumps({'mem': mem, 'list': ck.list(tiers=True)}), flush=True)\n"
    "os.kill(os.getpid(), signal.SIGKILL)\n"
)


def test_flash_restore_holds_the_memory_only_step_of_a_sigkilled_checkpointer(root):
    """keep_in_memory with a disk cadence, same settings: after a SIGKILL, the next
    checkpointer takes the kept arena over with its memory-only step in place and holds it
    as its own memory-only step (nothing written at open), served from memory byte-exact;
    closing writes it to disk."""
    from conftest import remove_arenas_of, shm_arenas_of

    here = str(__import__("pathlib").Path(__file__).resolve().parent)
    try:
        p = zygote.run(
            [sys.executable, "-c", _KILLED_KEEP_CHILD, str(root), here], capture_output=True, text=True, timeout=120
        )
        assert p.returncode == -9, p.stderr
        seen = json.loads(p.stdout.splitlines()[0])
        assert seen == {"mem": [False, True, True], "list": [[1, ["disk"]], [3, ["memory"]]]}, seen
        assert len(shm_arenas_of(root, "kept")) == 1
        tuning = shmckpt.Tuning(staging_capacity=32 << 20, chunk_size=1 << 20)
        with shmckpt.Checkpointer(root, keep_in_memory=True, cadence=shmckpt.Cadence(disk_every=10), tuning=tuning) as ck:
            assert ck.recovered == [3]
            # Step 3 is held in memory, as the dead checkpointer held it: not written yet.
            assert ck.list(tiers=True) == [(1, ["disk"]), (3, ["memory"])]
            assert sorted(q.name for q in root.iterdir() if q.name.startswith("step-")) == ["step-1"]
            assert_state(ck.load("latest"), 3)
            assert ck.last_load_source == ("memory", None)
            assert_state(ck.load(1), 1)
            assert ck.last_load_source[0] == "disk"
        # Closing wrote step 3 to disk: durable, and kept in memory for the next one.
        assert sorted(q.name for q in root.iterdir() if q.name.startswith("step-")) == ["step-1", "step-3"]
        with shmckpt.Checkpointer(root, keep_in_memory=True, cadence=shmckpt.Cadence(disk_every=10), tuning=tuning) as ck:
            assert ck.recovered == []
            assert ck.list(tiers=True) == [(1, ["disk"]), (3, ["memory", "disk"])]
            assert_state(ck.load("latest"), 3)
            assert ck.last_load_source == ("memory", None)
    finally:
        remove_arenas_of(root, "kept")


_KILLED_STEPS_CHILD = (
    "import json, os, signal, sys\n"
    "sys.path.insert(0, sys.argv[2])\n"
    "import shmckpt, test_cadence as t\n"
    "ck = shmckpt.Checkpointer(sys.argv[1], cadence=shmckpt.Cadence(disk_every=10, memory_steps=2),\n"
    "    tuning=shmckpt.Tuning(staging_capacity=32 << 20, chunk_size=1 << 20))\n"
    "mem = [ck.save(s, t.state(s)).wait()['memory_only'] for s in (1, 2, 3, 4)]\n"
    "print(json.dumps({'mem': mem, 'list': ck.list(tiers=True)}), flush=True)\n"
    "os.kill(os.getpid(), signal.SIGKILL)\n"
)


def test_memory_steps_holds_the_newest_and_all_are_recovered_after_sigkill(root):
    # In process: the two newest memory-only steps are held, each loadable.
    live = root / "live"
    with opened(live, cadence=shmckpt.Cadence(disk_every=10, memory_steps=2)) as ck:
        assert [save(ck, s)["memory_only"] for s in (1, 2, 3, 4)] == [False, True, True, True]
        assert ck.list(tiers=True) == [(1, ["disk"]), (3, ["memory"]), (4, ["memory"])]
        assert_state(ck.load(3), 3)
        assert ck.last_load_source == ("memory", None)
        assert_state(ck.load("latest"), 4)
        assert ck.last_load_source == ("memory", None)
        with pytest.raises(shmckpt.errors.NotFound):
            ck.load(2)
    # close() wrote both held steps to disk.
    with opened(live) as again:
        assert again.list(tiers=True) == [(1, ["disk"]), (3, ["disk"]), (4, ["disk"])]
        assert_state(again.load(3), 3)
        assert_state(again.load(4), 4)
    # After a SIGKILL, the next open recovers every held step.
    killed = root / "killed"
    here = str(__import__("pathlib").Path(__file__).resolve().parent)
    p = zygote.run(
        [sys.executable, "-c", _KILLED_STEPS_CHILD, str(killed), here], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == -9, p.stderr
    seen = json.loads(p.stdout.splitlines()[0])
    assert seen == {"mem": [False, True, True, True], "list": [[1, ["disk"]], [3, ["memory"]], [4, ["memory"]]]}, seen
    with opened(killed) as ck:
        assert ck.recovered == [3, 4]
        assert ck.list(tiers=True) == [(1, ["disk"]), (3, ["disk"]), (4, ["disk"])]
        assert_state(ck.load(3), 3)
        assert_state(ck.load("latest"), 4)
        assert ck.last_load_source[0] == "disk"
    with pytest.raises(ConfigError):
        opened(root / "bad", cadence=shmckpt.Cadence(disk_every=2, memory_steps=0))
