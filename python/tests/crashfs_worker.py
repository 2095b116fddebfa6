"""Child process of test_crashfs.py (not a test module).

    python crashfs_worker.py save ROOT RANK WORLD STEPS DIR   # save steps 1..STEPS, print reports
    python crashfs_worker.py restart ROOT WORLD NEXT CLI   # the restarted trainer (JSON)
"""

import json
import os
import subprocess
import sys
import time

import torch

import shmckpt
from shmckpt.errors import ShmckptError

KEEP = 2


def state(step: int, rank: int) -> dict:
    """What rank `rank` saves as `step`: ~140 KiB, several 64 KiB chunks."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(128, 257, generator=g), "b": torch.arange(rank + step, dtype=torch.int64)}


def open_ck(root: str, rank: int, world: int) -> shmckpt.Checkpointer:
    """Rank `rank`'s checkpointer (retention, recovery on open, small chunks)."""
    return shmckpt.Checkpointer(
        root,
        rank=rank,
        world_size=world,
        keep_last=KEEP,
        recover_on_open=True,
        tuning=shmckpt.Tuning(staging_capacity=4 << 20, chunk_size=64 << 10),
    )


def arrive(where: str, rank: int) -> None:
    """Mark rank `rank` as past its open."""
    open(os.path.join(where, f"open-{rank}"), "w").close()


def barrier(where: str, rank: int, world: int) -> None:
    """Every rank's engine is open before any saves (as the constructor's barrier does
    under torch.distributed): opening an engine removes the root's partial directories."""
    arrive(where, rank)
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(where, f"open-{r}")) for r in range(world)):
        if time.monotonic() > deadline:
            sys.exit("barrier: the other ranks never opened")
        time.sleep(0.01)


def save(root: str, rank: int, world: int, steps: int, where: str) -> None:
    """Save until done or until the filesystem fails (the power is off: die, as a trainer
    whose machine lost power would, without closing anything)."""
    try:
        ck = open_ck(root, rank, world)
    except ShmckptError as e:
        arrive(where, rank)  # the others must not wait for a rank that died
        print(f"failed {type(e).__name__}: {e}", flush=True)
        os._exit(3)
    barrier(where, rank, world)
    try:
        for step in range(1, steps + 1):
            rep = ck.save(step, state(step, rank)).wait()
            if rep.get("dir"):
                print(f"reported {step}", flush=True)
        ck.close()
    except ShmckptError as e:
        print(f"failed {type(e).__name__}: {e}", flush=True)
        os._exit(3)
    print("done", flush=True)


def leftovers(root: str) -> list:
    """The partial and trash directories in `root`."""
    return sorted(n for n in os.listdir(root) if n.endswith((".partial", ".trash")))


def same(ck: shmckpt.Checkpointer, step: object, want: dict) -> bool:
    """Whether `step` loads as exactly `want` (same names, dtypes, shapes and values)."""
    got = ck.load(step)
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def restart(root: str, world: int, nxt: int, cli: str) -> dict:
    """The restarted trainer on the durable state: open with recovery, list, load every
    listed step on every rank, `shmckpt verify --all`, `shmckpt gc --keep KEEP`, then save
    step `nxt` on every rank. Returns what it saw (test_crashfs.py runs it in its own
    process: a fresh Checkpointer per rank, torch imported once)."""
    cks = [open_ck(root, r, world) for r in range(world)]
    out: dict = {"list": cks[0].list(), "latest": cks[0].latest(), "bad": []}

    def newer_with_parts(merged: bool = True) -> list:
        """The partial directories of steps newer than the newest committed one that hold
        a durable part: a rank's part manifest, or (``merged``) the merged manifest."""
        return [
            n
            for n in leftovers(root)
            if n.endswith(".partial")
            and (out["latest"] is None or int(n[len("step-") : -len(".partial")]) > out["latest"])
            and any(
                (merged and f == "manifest.json") or (f.startswith("rank-") and f.endswith(".manifest.json"))
                for f in os.listdir(os.path.join(root, n))
            )
        ]

    # The partial-part rule (docs/guarantees.md): an open keeps a partial directory that
    # holds a durable part of a step newer than the newest committed one; only a newer
    # commit or `shmckpt gc` removes it. (Checked before the loads: a load before a save
    # is a resume, which withdraws its rank's parts of newer steps.)
    out["leftovers"] = leftovers(root)
    out["kept_by_rule"] = newer_with_parts()
    for s in out["list"]:
        out["bad"] += [[s, r] for r, ck in enumerate(cks) if not same(ck, s, state(s, r))]
    if out["latest"] is not None and not same(cks[0], "latest", state(out["latest"], 0)):
        out["bad"].append(["latest", 0])
    # Every rank loaded (resumed) when a step is committed: no rank's part of a newer step
    # is left (a merged manifest that was never renamed is no rank's part: a new commit of
    # the step writes its own).
    out["parts_after_resume"] = newer_with_parts(merged=False) if out["list"] else None
    for ck in cks:
        ck.close()

    def run(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run([cli, *a], capture_output=True, text=True, timeout=120)

    v = run("verify", root, "--all") if out["list"] else None
    out["verify"] = None if v is None else [v.returncode, v.stdout + v.stderr]
    g = run("gc", root, "--keep", str(KEEP))
    out["gc"] = [g.returncode, g.stdout + g.stderr]
    out["leftovers_after_gc"] = leftovers(root)
    cks = [open_ck(root, r, world) for r in range(world)]
    out["after_gc"] = cks[0].list()
    reps = [ck.save(nxt, state(nxt, r)).wait() for r, ck in enumerate(cks)]
    out["next_committed"] = any(r.get("dir") for r in reps)
    out["after_next"] = cks[0].list()
    out["next_exact"] = all(same(ck, nxt, state(nxt, r)) for r, ck in enumerate(cks))
    for ck in cks:
        ck.close()
    return out


if __name__ == "__main__":
    role, root = sys.argv[1], sys.argv[2]
    if role == "save":
        save(root, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif role == "restart":
        print(json.dumps(restart(root, int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])), flush=True)
    else:
        sys.exit(f"unknown role {role}")
