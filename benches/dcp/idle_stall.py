"""Slow staging of ShmckptWriter saves, outside the training loop. (The loop's round-2
first save through DCP stalled 5-6 s; this asks whether idle time, other engines' work or
the DCP path is what matters.) A GPU state of 1,312 bf16 tensors; one ShmckptWriter
engine (`prepare`) and one native Checkpointer (`prepare_cuda`) in the same process, on
the same tensors. Each saves (--dcp-saves, --native-saves) at the start and again after
each phase: sleeping (--idle-s), or other work (each --bench command, e.g. a
`shmckpt bench --load` process). Per save: the staging time (ShmckptWriter.last_stage,
the native save's blocking time), the calling thread's and the process's CPU time, minor
faults and VmPin/VmLck/VmRSS over the call; per phase the kernel's memory counters
(/proc/vmstat). Everything goes to OUT/idle_stall.json. --delete says when a finished
ShmckptWriter checkpoint is deleted (now, or once the next save has staged).

python3 benches/dcp/idle_stall.py --out OUT --dir DIR [--gib 16] [--idle-s 90] [--bench CMD]...
"""
import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shmckpt
from shmckpt.dcp import ShmckptWriter, prepare, release

VMSTAT = ("compact_", "thp_", "numa_", "pgmigrate", "pgfault", "pgmajfault", "nr_shmem", "nr_mlock", "nr_unevictable")


def vmstat():
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k.startswith(VMSTAT):
                out[k] = int(v)
    return out


def proc_status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmPin", "VmLck", "VmRSS"):
                out[k] = int(v.split()[0]) * 1024
    return out


def probe():
    """What the calling thread and the process spent, and the pinned memory, now."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"thread_cpu": time.thread_time(), "process_cpu": time.process_time(), "minflt": r.ru_minflt, "majflt": r.ru_majflt, **proc_status()}


def probe_delta(a, b):
    return {k: b[k] - a[k] for k in a}


def delta(a, b):
    return {k: b[k] - a.get(k, 0) for k in b if b[k] != a.get(k, 0)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--gib", type=float, default=16)
    p.add_argument("--tensors", type=int, default=1312)
    p.add_argument("--idle-s", type=float, default=90)
    p.add_argument("--dcp-saves", type=int, default=2, help="ShmckptWriter saves after each phase")
    p.add_argument("--native-saves", type=int, default=2, help="Checkpointer saves after each phase")
    p.add_argument("--delete", default="now", choices=["now", "after-next"], help="when a finished ShmckptWriter checkpoint is deleted")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    p.add_argument("--bench", action="append", default=[], help="a command run as an 'other work' phase")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    per = int(a.gib * (1 << 30)) // a.tensors // 2
    state = {f"layer{i}.w": torch.randn(per, device=a.device).to(torch.bfloat16) for i in range(a.tensors)}
    nbytes = sum(t.numel() * 2 for t in state.values())
    cap = nbytes + (256 << 20)
    base = tempfile.mkdtemp(dir=a.dir)
    t = time.perf_counter()
    prep = prepare(os.path.join(base, "dcp"), staging_capacity=cap)
    os.makedirs(os.path.join(base, "native"))
    ck = shmckpt.Checkpointer(os.path.join(base, "native"), tuning=shmckpt.Tuning(staging_capacity=cap), keep_last=1)
    if a.device == "cuda":
        ck.prepare_cuda()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    res = {"bytes": nbytes, "tensors": a.tensors, "setup_s": time.perf_counter() - t, "prepare": prep, "saves": [], "phases": []}
    seq = [0]
    pending = []  # finished ShmckptWriter checkpoints not deleted yet (--delete after-next)

    def dcp_save(phase):
        seq[0] += 1
        w = ShmckptWriter(os.path.join(base, "dcp", f"s{seq[0]}"), tuning=shmckpt.Tuning(staging_capacity=cap))
        sync()
        p0 = probe()
        t0 = time.perf_counter()
        r = dcp.async_save(state, storage_writer=w)
        ret = time.perf_counter() - t0
        p1 = probe()
        while pending:  # --delete after-next: the previous one, now that this one staged
            shutil.rmtree(pending.pop(0))
        r.upload_completion.result() if hasattr(r, "upload_completion") else r.result()
        rec = {"phase": phase, "system": "dcp-shm", "return_s": ret, "durable_s": time.perf_counter() - t0, "stage": dict(w.last_stage), "during_call": probe_delta(p0, p1), "pinned_after": p1["VmPin"], "disk_free": shutil.disk_usage(base).free}
        # The disk holds a few states only: delete this one now, or (--delete after-next)
        # once the next save has staged, so that no unlink (and the discards ext4 sends
        # for it at its next journal commit) precedes a save's staging.
        done_dir = os.path.join(base, "dcp", f"s{seq[0]}")
        if a.delete == "now":
            shutil.rmtree(done_dir)
        else:
            pending.append(done_dir)
        res["saves"].append(rec)
        print(json.dumps(rec)[:400], flush=True)

    def native_save(phase):
        seq[0] += 1
        sync()
        p0 = probe()
        t0 = time.perf_counter()
        h = ck.save(seq[0], state)
        ret = time.perf_counter() - t0
        p1 = probe()
        h.wait()
        rec = {"phase": phase, "system": "native", "return_s": ret, "durable_s": time.perf_counter() - t0, "during_call": probe_delta(p0, p1), "pinned_after": p1["VmPin"], "disk_free": shutil.disk_usage(base).free}
        res["saves"].append(rec)
        print(json.dumps(rec), flush=True)

    def both(phase):
        for _ in range(a.dcp_saves):
            dcp_save(phase)
        for _ in range(a.native_saves):
            native_save(phase)

    both("start")
    phases = [("idle", None)] + [(f"other{i}", c) for i, c in enumerate(a.bench)]
    for name, cmd in phases:
        v0, t0 = vmstat(), time.perf_counter()
        if cmd is None:
            time.sleep(a.idle_s)
            rc = None
        else:
            with open(os.path.join(a.out, f"{name}.json"), "w") as f:
                rc = subprocess.run(shlex.split(cmd), stdout=f, stderr=subprocess.DEVNULL).returncode
        ph = {"phase": name, "cmd": cmd, "rc": rc, "s": time.perf_counter() - t0, "vmstat": delta(v0, vmstat())}
        res["phases"].append(ph)
        print(json.dumps(ph), flush=True)
        v1 = vmstat()
        both(f"after-{name}")
        res["phases"][-1]["vmstat_during_saves"] = delta(v1, vmstat())
    for d in pending:
        shutil.rmtree(d)
    ck.close()
    release()
    with open(os.path.join(a.out, "idle_stall.json"), "w") as f:
        json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
