"""examples/train.py and examples/train_ddp.py (torchrun, gloo) on the CPU: run once
uninterrupted, run again killed (SIGKILL) right after a non-blocking save, restart, and
compare every loss and the final weights and optimizer state exactly."""

import os
import pathlib
import subprocess
import sys

import pytest

from conftest import REPO
import zygote

EXAMPLES = REPO / "examples"


def env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")


def read_log(path):
    """{step: loss hex} and the final digest; a step logged twice (before the kill and
    again after the restart) must have logged the same loss, bit for bit."""
    losses, final = {}, None
    for line in pathlib.Path(path).read_text().splitlines():
        k, v = line.split()
        if k == "final":
            assert final is None, "two final lines"
            final = v
            continue
        s = int(k)
        assert losses.setdefault(s, v) == v, f"step {s} logged {losses[s]} then {v}"
    return losses, final


def run(args, **kw):
    return zygote.run(args, capture_output=True, text=True, env=env(), timeout=300, **kw)


def test_single_process_example_resumes_bit_identically_after_sigkill(tmp_path):
    script = str(EXAMPLES / "train.py")
    common = ["--steps", "30", "--every", "5", "--device", "cpu"]
    ref = run([sys.executable, script, "--ckpt", str(tmp_path / "ref"), "--loss-log", str(tmp_path / "ref.log")] + common)
    assert ref.returncode == 0, ref.stderr
    ref_losses, ref_final = read_log(tmp_path / "ref.log")
    assert sorted(ref_losses) == list(range(30)) and ref_final

    args = [sys.executable, script, "--ckpt", str(tmp_path / "run"), "--loss-log", str(tmp_path / "run.log")] + common
    killed = zygote.spawn(args + ["--kill-at", "15"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env())
    out, err = killed.communicate(timeout=300)
    assert killed.returncode == -9, err
    losses, final = read_log(tmp_path / "run.log")
    assert max(losses) == 15 and final is None  # died right after step 15's save call

    again = run(args)
    assert again.returncode == 0, again.stderr
    resumed = int(again.stdout.split("resumed from step ")[1].split()[0])
    assert resumed in (10, 15), again.stdout  # 15 when its save was staged (recovered)
    losses, final = read_log(tmp_path / "run.log")
    assert losses == ref_losses
    assert final == ref_final
    # The killed process's staging arena was recovered and removed by the restart.
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"shmckpt.{killed.pid}.")] == []
    steps = sorted(int(n.split("-")[1]) for n in os.listdir(tmp_path / "run") if n.startswith("step-") and "." not in n)
    assert steps == [20, 25, 29]  # keep_last=3


def test_torchrun_example_resumes_bit_identically_after_sigkill(tmp_path):
    script = str(EXAMPLES / "train_ddp.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    common = ["--steps", "24", "--every", "4"]
    ref = run(torchrun + [script, "--ckpt", str(tmp_path / "ref"), "--loss-log", str(tmp_path / "ref")] + common)
    assert ref.returncode == 0, ref.stderr[-4000:]
    refs = [read_log(tmp_path / f"ref.rank{r}") for r in range(2)]
    for losses, final in refs:
        assert sorted(losses) == list(range(24)) and final
    assert refs[0][1] == refs[1][1]  # DDP: the same weights on both ranks
    assert refs[0][0] != refs[1][0]  # ... from different data

    args = torchrun + [script, "--ckpt", str(tmp_path / "run"), "--loss-log", str(tmp_path / "run")] + common
    killed = run(args + ["--kill-at", "12", "--kill-rank", "1"])
    assert killed.returncode != 0, killed.stdout
    l1, f1 = read_log(tmp_path / "run.rank1")
    assert max(l1) == 12 and f1 is None

    again = run(args)
    assert again.returncode == 0, again.stderr[-4000:]
    resumed = int(again.stdout.split("resumed from step ")[1].split()[0])
    assert resumed in (8, 12), again.stdout
    for r in range(2):
        losses, final = read_log(tmp_path / f"run.rank{r}")
        assert losses == refs[r][0], r
        assert final == refs[r][1], r
