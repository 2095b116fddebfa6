"""Power cuts through the kernel, from Python (issue 28; docs/crash.md).

Two rank processes save with ``shmckpt.Checkpointer`` (``keep_last=2``) into a crashfs
mount: a FUSE filesystem (the ``crashfs`` binary of the workspace, on ``fuser``) that
keeps file data volatile until ``fsync`` and directory entries until the directory's
``fsync``, and cuts the power at its n-th mutating request. The ranks die with the
power (their arenas are removed: a power loss clears ``/dev/shm``); the durable state is
mounted again and a restarted trainer checks it: every listed step loads with exactly its
bytes on every rank, ``latest`` is the newest listed, every step reported committed
before the cut is listed unless ``keep`` newer ones are, no partial directory survives the
open, ``shmckpt verify --all`` passes, ``shmckpt gc --keep 2`` keeps the newest two, and
the next save commits on top.

Needs root, ``/dev/fuse`` and the ``crashfs`` binary (``CRASHFS_BIN``, else
``target/debug/crashfs``): skips otherwise; ``SHMCKPT_REQUIRE_FUSE=1`` makes that a
failure. ``SHMCKPT_CRASHFS_SEED`` and ``SHMCKPT_CRASHFS_PY_ITERS`` choose the cuts.
"""

import os
import pathlib
import random
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import pytest

import crashfs_worker
from conftest import REPO, shmckpt_bin

WORKER = str(pathlib.Path(__file__).with_name("crashfs_worker.py"))
WORLD = 2
STEPS = 4
KEEP = 2


def crashfs_bin() -> Optional[str]:
    """The crashfs binary (CRASHFS_BIN, else target/{debug,release}/crashfs)."""
    env = os.environ.get("CRASHFS_BIN")
    if env:
        return env
    for p in (REPO / "target" / "debug" / "crashfs", REPO / "target" / "release" / "crashfs"):
        if p.is_file():
            return str(p)
    return None


def missing() -> Optional[str]:
    """Why no crashfs mount can be made here, or None."""
    if os.geteuid() != 0:
        return "not root (the FUSE mount is made with the mount system call)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"/dev/fuse: {e}"
    if crashfs_bin() is None:
        return "no crashfs binary (cargo build -p crashfs, or set CRASHFS_BIN)"
    if shmckpt_bin() is None:
        return "no shmckpt binary (cargo build --bin shmckpt, or set SHMCKPT_BIN)"
    return None


@pytest.fixture
def fuse_ok() -> None:
    why = missing()
    if why is None:
        return
    if os.environ.get("SHMCKPT_REQUIRE_FUSE") == "1":
        pytest.fail(f"SHMCKPT_REQUIRE_FUSE=1 but {why}")
    pytest.skip(f"{why} (set SHMCKPT_REQUIRE_FUSE=1 to make this a failure)")


class Fs:
    """A running crashfs serving `image` at `mnt`."""

    def __init__(self, mnt: pathlib.Path, image: pathlib.Path, cut_at: Optional[int] = None):
        self.mnt = mnt
        args = [str(crashfs_bin()), str(mnt), str(image)]
        if cut_at is not None:
            args += ["--cut-at", str(cut_at)]
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.p.stdout is not None
        line = self.p.stdout.readline().strip()
        assert line == "mounted", line

    def kill(self, mnt: pathlib.Path) -> None:
        """After a failure: end the server and detach its mount."""
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

    def stop(self) -> Tuple[int, bool]:
        """Unmount: the image keeps what survives. Returns (mutations, whether cut)."""
        out, _ = self.p.communicate("stop\n", timeout=300)
        assert self.p.returncode == 0, out
        assert not os.path.ismount(self.mnt), f"{self.mnt} is still mounted after stop"
        words = out.split()
        assert words[0] == "mutations" and words[2] == "cut", out
        return int(words[1]), words[3] == "true"


def clear_arenas(pids: List[int]) -> None:
    """A power loss clears /dev/shm: remove the dead ranks' arenas (ours)."""
    for name in os.listdir("/dev/shm"):
        if any(name.startswith(f"shmckpt.{pid}.") for pid in pids):
            os.unlink(os.path.join("/dev/shm", name))


def train(mnt: pathlib.Path, barrier: pathlib.Path) -> Tuple[List[int], Dict[int, str]]:
    """Both ranks save steps 1..STEPS; returns the steps reported committed, and how each
    rank ended. `barrier`: an empty directory, where the ranks meet once open."""
    ps = [
        subprocess.Popen(
            [sys.executable, WORKER, "save", str(mnt), str(r), str(WORLD), str(STEPS), str(barrier)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(WORLD)
    ]
    reported, ends = set(), {}
    for r, p in enumerate(ps):
        out, err = p.communicate(timeout=120)
        assert p.returncode in (0, 3), (r, p.returncode, out, err)
        reported |= {int(line.split()[1]) for line in out.splitlines() if line.startswith("reported ")}
        ends[r] = out.splitlines()[-1] if out else err[-300:]
    clear_arenas([p.pid for p in ps])
    return sorted(reported), ends


def fresh(d: pathlib.Path) -> pathlib.Path:
    d.mkdir()
    return d


def restart(mnt: pathlib.Path, image: pathlib.Path) -> dict:
    """Mount the image and run the restarted trainer (in this process)."""
    fs = Fs(mnt, image)
    try:
        res = crashfs_worker.restart(str(mnt), WORLD, STEPS + 1, str(shmckpt_bin()))
    except BaseException:
        fs.kill(mnt)
        raise
    fs.stop()
    return res


def check(res: dict, reported: List[int], what: str) -> None:
    listed = res["list"]
    assert all(1 <= s <= STEPS for s in listed), (what, res)
    assert res["bad"] == [], (what, res)
    assert res["latest"] == (listed[-1] if listed else None), (what, res)
    for s in reported:
        assert s in listed or sum(1 for x in listed if x > s) >= KEEP, (what, f"step {s} reported and gone", res)
    # An open removes every partial directory but those the partial-part rule keeps (a
    # durable part of a step newer than the newest committed); gc removes those too.
    assert res["leftovers"] == res["kept_by_rule"], (what, res)
    # Every rank loaded a committed step before saving (a resume): each withdrew its parts
    # of the newer uncommitted steps, so no new save can merge with them.
    if listed:
        assert res["parts_after_resume"] == [], (what, res)
    assert res["leftovers_after_gc"] == [], (what, res)
    if listed:
        assert res["verify"][0] == 0, (what, res)
    assert res["gc"][0] == 0, (what, res)
    assert res["after_gc"] == listed[-KEEP:], (what, res)
    assert res["next_committed"] is True, (what, res)
    assert res["after_next"] == (listed[-KEEP:] + [STEPS + 1])[-KEEP:], (what, res)
    assert res["next_exact"] is True, (what, res)


def test_two_python_ranks_survive_power_cuts_through_fuse(fuse_ok: None, tmp_path: pathlib.Path) -> None:
    mnt, image = tmp_path / "mnt", tmp_path / "image"
    mnt.mkdir()
    image.mkdir()
    # The uncrashed run counts the requests a run makes.
    fs = Fs(mnt, image)
    try:
        reported, ends = train(mnt, fresh(tmp_path / "barrier-0"))
    except BaseException:
        fs.kill(mnt)
        raise
    total, cut = fs.stop()
    assert not cut and reported == list(range(1, STEPS + 1)), (reported, ends)
    check(restart(mnt, image), reported, "uncrashed")

    rng = random.Random(int(os.environ.get("SHMCKPT_CRASHFS_SEED", "2026")))
    iters = int(os.environ.get("SHMCKPT_CRASHFS_PY_ITERS", "4"))
    cuts = commits = 0
    for i in range(iters):
        for p in image.iterdir():
            subprocess.run(["rm", "-rf", str(p)], check=True)
        n = rng.randrange(total)
        fs = Fs(mnt, image, cut_at=n)
        try:
            reported, ends = train(mnt, fresh(tmp_path / f"barrier-{i + 1}"))
        except BaseException:
            fs.kill(mnt)
            raise
        _, cut = fs.stop()
        assert cut or all(e == "done" for e in ends.values()), ("a rank failed with the power on", ends)
        cuts += cut
        commits += len(reported)
        check(restart(mnt, image), reported, f"iteration {i}: cut at request {n} of {total}, ranks ended {ends}")
    print(f"crashfs, 2 Python ranks: {iters} power cuts at random requests of {total} ({cuts} before the end; {commits} commits reported before them), 0 violations")
