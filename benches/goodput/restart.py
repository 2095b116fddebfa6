"""Restart after a SIGKILL with the memory tier: the time from a new process's
``Checkpointer(...)`` to the resumed state in memory, with and without flash restore.

Each round, for each mode (order alternated round by round), a child process opens
``Checkpointer(root, cadence=Cadence(disk_every=10), keep_in_memory=MODE)``, saves step 1
(to disk, the first save) and step 2 (memory-only), waits until its arena is allocated
whole (as it is in a trainer that ran a while) and kills itself with SIGKILL. A second
process, the restart, imports shmckpt and torch (untimed), then times

- ``open``: ``Checkpointer(...)``, which recovers step 2 from the dead engine's arena
  (writes it to disk, fdatasync, commit) and builds its own arena (``plain``), or takes the
  kept arena over in place with step 2 still staged in it and holds step 2 as its own
  memory-only step, nothing written (``flash``; before 2026-12-05 recovery committed step 2
  first and the take-over checked it by CRC-32C as the kept image);
  (``Checkpointer.open_timings`` splits it: recovery, the arena, the writers);
- ``load``: ``load("latest")`` into host memory (``plain``: read back from the file;
  ``flash``: copied from the kept image),

checks every byte of the loaded state against the closed form and that steps 1 and 2 are
listed (on disk, or held in memory), and closes (``flash``: writing step 2 to disk). Output: per mode the medians of open, load and their sum, with the spread
(min-max) over the rounds, and the ratio plain / flash of the sums, as JSON and a Markdown
table.

    python3 benches/goodput/restart.py --size-mib 1024 --rounds 7 --out /tmp/restart
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

N_TENSORS = 8
CHILD = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[4])
import restart as r
ck = r.open_ck(sys.argv[1], sys.argv[2] == "flash", int(sys.argv[3]))
ck.save(1, r.state(1, int(sys.argv[3]))).wait()
rep = ck.save(2, r.state(2, int(sys.argv[3]))).wait()
assert rep["memory_only"], rep
# A trainer dies after running a while: its arena is allocated whole by then (the engine
# allocates it in the background; a partly allocated kept arena is not taken over).
import time
p = os.path.join("/dev/shm", ck.shm_name)
deadline = time.monotonic() + 300
while os.stat(p).st_blocks * 512 < os.stat(p).st_size:
    assert time.monotonic() < deadline, "the arena was not allocated within 300 s"
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""
RESTART = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
import restart as r
import torch
size = int(sys.argv[3])
t0 = time.perf_counter()
ck = r.open_ck(sys.argv[1], sys.argv[2] == "flash", size)
t1 = time.perf_counter()
got = ck.load("latest")
t2 = time.perf_counter()
source = ck.last_load_source
want = r.state(2, size)
assert got["step"] == 2 and sorted(got["w"]) == sorted(want["w"]), got.keys()
for k, t in want["w"].items():
    assert torch.equal(got["w"][k], t), k
assert sorted(s for s, _ in ck.list(tiers=True)) == [1, 2], ck.list(tiers=True)
assert ck.recovered == [2], ck.recovered
name = ck.shm_name
ck.close()
if sys.argv[2] == "flash":
    import os
    os.unlink(os.path.join("/dev/shm", name))  # the kept arena outlives the close by design
print(json.dumps({"open_s": t1 - t0, "load_s": t2 - t1, "source": source[0], "phases": ck.open_timings}))
"""


def state(step, size):
    """The state at ``step``: ``N_TENSORS`` fp32 tensors of ``size / N_TENSORS`` bytes,
    tensor i filled with the integer ``(31 step + 17 i) % 1000`` (exact in fp32)."""
    import torch

    n = size // N_TENSORS // 4
    return {"step": step, "w": {f"t{i}": torch.full((n,), float((31 * step + 17 * i) % 1000)) for i in range(N_TENSORS)}}


def open_ck(root, flash, size):
    import shmckpt

    return shmckpt.Checkpointer(
        root,
        keep_last=2,
        keep_in_memory=flash,
        cadence=shmckpt.Cadence(disk_every=10),
        tuning=shmckpt.Tuning(staging_capacity=3 * size + (64 << 20), chunk_size=8 << 20),
    )


def one(mode, args, here):
    root = os.path.join(args.dir, f"{mode}-{os.getpid()}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    size = args.size_mib << 20
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        c = subprocess.run([sys.executable, "-c", CHILD, root, mode, str(size), here], capture_output=True, text=True, env=env, timeout=900)
        if c.returncode != -9:
            raise RuntimeError(f"{mode}: the child exited {c.returncode}: {c.stderr[-2000:]}")
        # The page cache would serve the plain mode's read of the file recovery writes:
        # dropped before the restart, as a restart on another boot of the process finds it.
        subprocess.run(["sync"], check=True)
        if args.drop_caches:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
        r = subprocess.run([sys.executable, "-c", RESTART, root, mode, str(size), here], capture_output=True, text=True, env=env, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"{mode}: the restart failed: {r.stderr[-3000:]}")
        out = json.loads(r.stdout.splitlines()[-1])
        want = "memory" if mode == "flash" else "disk"
        if out["source"] != want:
            raise RuntimeError(f"{mode}: step 2 loaded from {out['source']}, expected {want}")
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default="/var/tmp/shmckpt-restart")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each restart (root)")
    ap.add_argument("--out", default=None, help="directory for restart.json and restart.md")
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    os.makedirs(args.dir, exist_ok=True)
    runs = {"plain": [], "flash": []}
    for i in range(args.rounds):
        order = ["plain", "flash"] if i % 2 == 0 else ["flash", "plain"]
        for mode in order:
            o = one(mode, args, here)
            runs[mode].append(o)
            ph = ", ".join(f"{k} {v:.3f}" for k, v in o["phases"].items())
            print(f"round {i} {mode}: open {o['open_s']:.3f} s ({ph}), load {o['load_s']:.3f} s", flush=True)
    res = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv, "size_bytes": args.size_mib << 20, "rounds": args.rounds}, "modes": {}}
    for mode, rs in runs.items():
        tot = [r["open_s"] + r["load_s"] for r in rs]
        res["modes"][mode] = {
            "open_s": statistics.median(r["open_s"] for r in rs),
            "load_s": statistics.median(r["load_s"] for r in rs),
            "total_s": statistics.median(tot),
            "total_range_s": [min(tot), max(tot)],
            "phases_s": {k: statistics.median(r["phases"][k] for r in rs) for k in rs[0]["phases"]},
            "runs": rs,
        }
    p, f = res["modes"]["plain"], res["modes"]["flash"]
    res["plain_over_flash"] = p["total_s"] / f["total_s"]
    md = [
        "| mode | open (recovery + arena) | of it recovery / arena / writers | load latest | sum, median [min, max] |",
        "|---|---|---|---|---|",
    ]
    for mode in ("plain", "flash"):
        m = res["modes"][mode]
        ph = m["phases_s"]
        md.append(f"| {mode} | {m['open_s']:.3f} s | {ph['recovery']:.3f} / {ph['arena']:.3f} / {ph['writers']:.3f} s | {m['load_s']:.3f} s | {m['total_s']:.3f} s [{m['total_range_s'][0]:.3f}, {m['total_range_s'][1]:.3f}] |")
    md.append(f"\nplain / flash: {res['plain_over_flash']:.2f}x over {args.rounds} alternated rounds, {args.size_mib} MiB")
    print("\n".join(md))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "restart.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        with open(os.path.join(args.out, "restart.md"), "w") as fh:
            fh.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
