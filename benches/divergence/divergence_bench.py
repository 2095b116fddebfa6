"""Cost of the replica divergence check (``Checkpointer(check_replicas=group)``) in a
training loop: WORLD ranks over gloo on one host, the same loop with and without the
check, in alternated rounds (docs/benchmarks.md, "Replica divergence check").

Each rank holds a state of TENSORS tensors (TOTAL MiB, identical on every rank: the
data-parallel replicas). A round runs STEPS training steps (a fixed CPU matmul workload)
and saves every EVERY steps (``blocking=False``, waited at the round's end); its wall time
is the loop's. Rounds alternate off/on; each mode keeps one Checkpointer (``keep_last=2``).

    python benches/divergence/divergence_bench.py --world 2 --tensors 1000 --total-mib 256 \
        --rounds 8 --steps 20 --every 5 --root /var/tmp/div-bench
"""

import argparse
import json
import os
import pickle
import shutil
import socket
import statistics
import subprocess
import sys
import time


def worker(a, rank):
    import torch
    import torch.distributed as dist

    import shmckpt

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", rank=rank, world_size=a.world)
    group = dist.new_group(backend="gloo")
    per = max(1, (a.total_mib << 20) // 4 // a.tensors)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(a.tensors)}
    x = torch.randn(384, 384, generator=g)
    cks = {}
    for mode in ("off", "on"):
        root = os.path.join(a.root, f"run-{a.port}", mode)  # a fresh root per run
        kw = {"check_replicas": group} if mode == "on" else {}
        cks[mode] = shmckpt.Checkpointer(root, keep_last=2, tuning=shmckpt.Tuning(staging_capacity=(a.total_mib + 64) << 20), **kw)
    step = {"off": 0, "on": 0}
    times = {"off": [], "on": []}
    in_save = {"off": [], "on": []}  # per round: seconds inside save() calls
    at_end = {"off": [], "on": []}  # per round: seconds waiting for the saves at its end
    checks = []
    for rnd in range(a.rounds + 1):  # round 0 of each mode: warm-up, not counted
        for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
            ck = cks[mode]
            dist.barrier()
            t0 = time.perf_counter()
            handles = []
            saving = 0.0
            for _ in range(a.steps):
                y = x
                for _ in range(a.work):
                    y = torch.tanh(y @ x)
                step[mode] += 1
                if step[mode] % a.every == 0:
                    t1 = time.perf_counter()
                    handles.append(ck.save(step[mode], state, blocking=False))
                    saving += time.perf_counter() - t1
            t2 = time.perf_counter()
            for h in handles:
                rep = h.wait()
                if mode == "on" and rnd > 0:
                    checks.append(rep["replica_check"])
            dist.barrier()
            if rnd > 0:
                times[mode].append(time.perf_counter() - t0)
                in_save[mode].append(saving)
                at_end[mode].append(time.perf_counter() - t2)
    # The check alone, ranks in step (a barrier first): the gather of this rank's digests
    # and the comparison, as ReplicaCheck does them.
    from shmckpt import _shmckpt

    mine = (rank, [(n, "float32", [per], 0x12345678) for n in state], "")
    digest_bytes = len(pickle.dumps(mine))
    alone = []
    for _ in range(30):
        dist.barrier(group=group)
        t1 = time.perf_counter()
        got = [None] * a.world
        dist.all_gather_object(got, mine, group=group)
        assert _shmckpt.replica_divergence([d for _, d, _ in got]) == []
        alone.append(time.perf_counter() - t1)
    for ck in cks.values():
        ck.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(a.root, f"run-{a.port}"))
    if rank == 0:
        print(json.dumps({"in_save": in_save, "at_end": at_end, "times": times, "checks": checks, "alone": alone, "digest_bytes": digest_bytes}))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--total-mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--work", type=int, default=4, help="matmuls per training step")
    p.add_argument("--root", default="/var/tmp/div-bench")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    if a.rank is not None:
        return worker(a, a.rank)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        a.port = s.getsockname()[1]
    os.makedirs(a.root, exist_ok=True)
    base = [sys.executable, __file__] + sys.argv[1:] + ["--port", str(a.port)]
    procs = [subprocess.Popen(base + ["--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in range(a.world)]
    out = [pr.communicate()[0] for pr in procs]
    if any(pr.returncode for pr in procs):
        sys.exit("a rank failed")
    res = json.loads(out[0].strip().splitlines()[-1])
    off, on = res["times"]["off"], res["times"]["on"]
    ratios = [b / a_ for a_, b in zip(off, on)]
    saves = a.steps // a.every
    med = statistics.median
    print(f"world {a.world}, {a.tensors} tensors, {a.total_mib} MiB per rank, {a.rounds} rounds x {a.steps} steps, a save every {a.every}")
    print(f"loop off: median {med(off):.4f} s ({min(off):.4f}-{max(off):.4f}); per step {med(off) / a.steps * 1e3:.2f} ms")
    print(f"loop on:  median {med(on):.4f} s ({min(on):.4f}-{max(on):.4f}); per step {med(on) / a.steps * 1e3:.2f} ms")
    print(f"on/off per round: median {med(ratios):.4f} ({min(ratios):.4f}-{max(ratios):.4f})")
    for mode in ("off", "on"):
        i, e = res["in_save"][mode], res["at_end"][mode]
        print(f"  {mode}: per round in save() median {med(i):.4f} s ({min(i):.4f}-{max(i):.4f}), waiting at the end {med(e):.4f} s ({min(e):.4f}-{max(e):.4f})")
    c = res["checks"]
    print(f"check per save (from this rank's checksums known: waiting for the other ranks' + gather + compare): median {med(c) * 1e3:.2f} ms ({min(c) * 1e3:.2f}-{max(c) * 1e3:.2f}), {len(c)} saves, {saves} per round")
    c = res["alone"]
    print(f"gather + compare alone (ranks in step): median {med(c) * 1e3:.2f} ms ({min(c) * 1e3:.2f}-{max(c) * 1e3:.2f}), {len(c)} runs")
    print(f"digest gathered per rank: {res['digest_bytes']} bytes")


if __name__ == "__main__":
    main()
