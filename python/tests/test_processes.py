"""Several processes: gloo ranks, SIGKILL mid-save then `shmckpt recover`, resources."""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import shmckpt

from conftest import free_port, shmckpt_bin
from dist_worker import big_state, digest, rank_state
import zygote

HERE = pathlib.Path(__file__).resolve().parent
WORKER = str(HERE / "dist_worker.py")


def _run_ranks(tmp_path, tag, world, worker_args):
    """Run ``world`` dist_worker.py ranks, ``worker_args(rank, port, out)`` each, to the
    end (killed past 120 s); every rank must exit 0. Returns each rank's JSON output."""
    port = free_port()
    outs = [tmp_path / f"{tag}{r}.json" for r in range(world)]
    procs = [zygote.spawn([sys.executable, WORKER, *worker_args(r, port, outs[r])]) for r in range(world)]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * world
    return [json.loads(o.read_text()) for o in outs]


def _session_run(root, tmp_path, phase):
    return _run_ranks(
        tmp_path, phase, 2, lambda r, port, out: ["session", str(root), str(r), "2", str(port), str(out), phase]
    )


def test_a_new_run_never_commits_a_step_with_a_dead_runs_part(root, tmp_path):
    """The ranks of a run share a session (rank 0's, broadcast by the constructor): a dead
    run left rank 1's durable part of step 3 and nothing committed, so the new run loads
    nothing and nothing withdraws that part. Rank 0 of the new run saves step 3 first: it
    does not commit (before sessions, it committed step 3 with rank 1's file of the dead
    run, and rank 1's save then failed with StepExists); rank 1's save commits it, every
    rank loads its own new bytes, and both files name the new run's session."""
    dead = _session_run(root, tmp_path, "dead")
    assert [r["latest_at_open"] for r in dead] == [None, None]
    part = json.loads((root / "step-3.partial" / "rank-00001.manifest.json").read_text())
    old_session = part["session"]
    assert isinstance(old_session, str) and len(old_session) == 32
    new = _session_run(root, tmp_path, "new")
    assert [r["latest_at_open"] for r in new] == [None, None]
    assert new[0]["committed_by_rank_0_alone"] == []
    assert [r["loaded_exact"] for r in new] == [True, True]
    assert new[0]["sessions"] == new[1]["sessions"]
    s0, s1 = new[0]["sessions"]
    assert s0 == s1 and isinstance(s0, str) and len(s0) == 32 and s0 != old_session
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-3"]


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_save_and_load(root, tmp_path, world):
    """Each rank saves its own state (blocking, non-blocking, a DTensor shard) and loads it.

    Ranks commit concurrently: this exposes the engine's commit race (a rank whose partial
    directory another rank has just renamed into place fails with `IoError: open
    step-N.partial`); it passes reliably with the fix to `commit::commit` that treats a
    missing partial directory as success when the step is committed."""
    results = _run_ranks(
        tmp_path, "out", world, lambda r, port, out: ["gloo", str(root), str(r), str(world), str(port), str(out)]
    )
    for r, res in enumerate(results):
        assert res["latest"] == 6 and res["list"] == [5, 6]
        assert res["ok"] == [True] * 4, (r, res)
        assert res["world_in_manifest"] == world
        assert res["dtensor_ok"] is True
    # Each rank's file is a plain safetensors file with that rank's tensors.
    for r in range(world):
        f = load_file(str(root / "step-6" / f"rank-{r:05d}-of-{world:05d}.safetensors"))
        want = rank_state(r, world, 6)
        assert digest(f["model.w"]) == digest(want["model"]["w"])
        assert digest(f["model.b"]) == digest(want["model"]["b"])


def test_sigkill_after_staging_then_shmckpt_recover(root):
    exe = shmckpt_bin()
    assert exe, "the shmckpt binary is missing: run `cargo build` or set SHMCKPT_BIN"
    recovered = 0
    for attempt, step in enumerate((2, 3, 4)):
        p = zygote.run([sys.executable, WORKER, "kill", str(root), str(step)], capture_output=True, text=True, timeout=120)
        assert p.returncode == -9, p.stderr
        shm = p.stdout.strip()
        assert shm.startswith("shmckpt."), p.stdout
        committed_before = (root / f"step-{step}" / "manifest.json").exists()
        assert os.path.exists(f"/dev/shm/{shm}")  # the staged save survived the trainer
        r = subprocess.run([exe, "recover", str(root)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert not os.path.exists(f"/dev/shm/{shm}")
        if not committed_before:
            recovered += 1
        with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=1 << 20, chunk_size=64 << 10)) as c:
            assert step in c.list() and 1 in c.list()
            back = c.load(step)
            assert back["step"] == step and digest(back["w"]) == digest(big_state(step)["w"])
            assert digest(c.load(1)["w"]) == digest(torch.arange(10))
        if recovered:
            break
    assert recovered >= 1, "every kill landed after the commit: recovery was never exercised"


_CYCLE_CHILD = (
    "import json, os, signal, sys, torch, shmckpt\n"
    "root, step = sys.argv[1], int(sys.argv[2])\n"
    "tuning = shmckpt.Tuning(staging_capacity=16 << 20, chunk_size=64 << 10, writer_threads=1, queue_depth=1)\n"
    "ck = shmckpt.Checkpointer(root, tuning=tuning)\n"
    "print(json.dumps({'recovered': ck.recovered, 'latest': ck.latest(), 'shm': ck.shm_name}), flush=True)\n"
    "g = torch.Generator().manual_seed(step)\n"
    "ck.save(step, {'w': torch.randint(-(2**31), 2**31 - 1, (2 << 20,), dtype=torch.int32, generator=g)})\n"
    "os.kill(os.getpid(), signal.SIGKILL)\n"
)


def _cycle_state(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(-(2**31), 2**31 - 1, (2 << 20,), dtype=torch.int32, generator=g)


def test_sigkill_cycles_recover_every_step_by_default_and_leave_dev_shm_flat(root):
    """Issue 36, items 7 and 8: 10 cycles of (a default ``Checkpointer`` opens the root,
    saves blocking, is SIGKILLed; the next one opens it). Every staged save comes back (the
    writer's commit or recovery at open, which says which steps it recovered), with its exact
    bytes, and no crashed trainer's staging segment is left in ``/dev/shm``."""
    cycles = 10
    pids, names, recovered = [], [], []
    for step in range(1, cycles + 2):
        p = zygote.spawn(
            [sys.executable, "-c", _CYCLE_CHILD, str(root), str(step)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = p.communicate(timeout=120)
        assert p.returncode == -9, err
        seen = json.loads(out.splitlines()[0])
        pids.append(p.pid)
        names.append(seen["shm"])
        assert seen["shm"].startswith(f"shmckpt.{p.pid}."), seen
        # The predecessor's save of step - 1 is committed: by its writer before the kill,
        # or by this open's recovery, which reports it.
        assert seen["latest"] == (step - 1 if step > 1 else None), (step, seen, err)
        assert set(seen["recovered"]) <= {step - 1}, (step, seen)
        recovered += seen["recovered"]
        # The predecessor's staging segment is gone.
        if step > 1:
            assert not os.path.exists(f"/dev/shm/{names[-2]}"), (step, names[-2])
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=16 << 20, chunk_size=64 << 10)) as c:
        assert c.recovered in ([], [cycles + 1])
        recovered += c.recovered
        assert c.list() == list(range(1, cycles + 2))
        for step in c.list():
            assert digest(c.load(step)["w"]) == digest(_cycle_state(step)), step
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"shmckpt.{pid}.") for pid in pids)]
    assert left == [], left
    assert recovered, "every kill landed after the commit: recovery was never exercised"
    print(f"recovered {len(recovered)} of {cycles + 1} steps at open: {recovered}")


def test_rss_fds_and_dev_shm_flat_across_100_saves(root, tmp_path):
    """No descriptor, staging segment or heap grows per save. The saves run in a child of
    their own: in the pytest process, other tests' objects close descriptors meanwhile."""
    import json

    out = tmp_path / "resources.json"
    p = subprocess.run([sys.executable, WORKER, "resources", str(root), str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    base, after = res["base"], res["after"]
    print(f"RSS {base['rss'] >> 20} -> {after['rss'] >> 20} MiB, fds {len(base['fds'])} -> {len(after['fds'])}")
    assert res["list"] == [128, 129]
    assert res["name"] in base["shm"] and res["name"] not in res["closed_shm"]  # closed: the arena is gone
    assert after["fds"] == base["fds"]
    assert after["shm"] == base["shm"]
    assert after["rss"] - base["rss"] < 8 << 20, f"RSS grew by {(after['rss'] - base['rss']) >> 20} MiB"
    assert not [n for n in res["closed_shm"] if n not in base["shm"]]


def test_interpreter_exit_finishes_a_non_blocking_save(root):
    code = (
        "import sys, torch, shmckpt\n"
        "ck = shmckpt.Checkpointer(sys.argv[1], tuning=shmckpt.Tuning(staging_capacity=64 << 20, chunk_size=1 << 20))\n"
        "ck.save(3, {'w': torch.arange(4 << 20, dtype=torch.int32)}, blocking=False)\n"
        "print(ck.shm_name)\n"
    )
    p = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    shm = p.stdout.strip()
    assert shm.startswith("shmckpt.") and not os.path.exists(f"/dev/shm/{shm}")
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20, chunk_size=1 << 20)) as c:
        assert c.list() == [3]
        assert digest(c.load(3)["w"]) == digest(torch.arange(4 << 20, dtype=torch.int32))
