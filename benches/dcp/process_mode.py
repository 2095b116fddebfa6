#!/usr/bin/env python3
"""ShmckptWriter under DCP's two async checkpointers: ``async_save(...,
async_checkpointer_type=THREAD)`` against ``PROCESS``, alternated round by round.

Per save: ``call_s`` (the trainer's stall: until ``async_save`` returns; the state may be
changed from then on), ``done_s`` (until the future's result: the checkpoint published)
and ``py_rate`` (iterations per second of a pure-Python loop the trainer runs while the
save uploads, divided by the same loop's rate measured for 0.3 s just before that save,
with nothing uploading: what DCP's
planning and commit in a thread of the trainer take from its Python work, which the
PROCESS checkpointer moves to another process). The first save of each type is
warm-up (engine and, for PROCESS, the checkpoint process starting) and is reported
apart. Prints one JSON object: per type, the median and range of each measure, and
each round's values.
``--idle``: the trainer waits for the future instead of running the loop (``done_s``
without a trainer competing for the cores).

    python benches/dcp/process_mode.py --dir /tmp/pm --mib 256 --tensors 512 --rounds 6
    torchrun --nproc-per-node 8 benches/dcp/process_mode.py --dir /mnt/nvme/pm --device cuda \\
        --mib 8192 --tensors 1312 --rounds 6

One process without torchrun initializes a gloo world of one (PROCESS needs a process
group). ``--device cuda`` puts the state on each rank's GPU (``LOCAL_RANK``).
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from shmckpt.dcp import ShmckptWriter, prepare

warnings.filterwarnings("ignore")


def python_loop(until) -> float:
    """Iterations per second of a small pure-Python loop, run until ``until()``."""
    n = 0
    t0 = time.perf_counter()
    while not until():
        for _ in range(2000):
            n += 1
    return n / (time.perf_counter() - t0)


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--mib", type=int, default=256, help="state size per rank")
    ap.add_argument("--tensors", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6, help="saves of each type after warm-up")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--idle", action="store_true", help="wait for the future without the Python loop (py_rate: none)")
    args = ap.parse_args()

    if "RANK" in os.environ:
        dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
    else:
        dist.init_process_group("gloo", init_method=f"file://{args.dir}.store", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(dev)
    per = (args.mib << 20) // args.tensors // 4
    state = {f"layer{i}.w": torch.randn(per, device=dev) for i in range(args.tensors)}
    state["step"] = 0
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    dist.barrier()
    prepare(args.dir, staging_capacity=(args.mib + 64) << 20, devices=[dev.index] if args.device == "cuda" else [])

    kinds = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
    rows = {k: [] for k in kinds}
    warm = {}
    for rnd in range(args.rounds + 1):
        order = list(kinds) if rnd % 2 == 0 else list(reversed(kinds))
        for kind in order:
            state["step"] = rnd
            path = os.path.join(args.dir, f"{kind}-{rnd}")
            dist.barrier()
            base = 0.0 if args.idle else python_loop(lambda t=time.perf_counter() + 0.3: time.perf_counter() > t)
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=ShmckptWriter(path), async_checkpointer_type=kinds[kind])
            call_s = time.perf_counter() - t0
            rate = 0.0 if args.idle else python_loop(fut.done)
            fut.result()
            done_s = time.perf_counter() - t0
            row = {"call_s": call_s, "done_s": done_s, "py_rate": rate / base if base else 0.0}
            if rnd == 0:
                warm[kind] = row
            else:
                rows[kind].append(row)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    out = {
        "ranks": world,
        "device": str(dev),
        "mib_per_rank": args.mib,
        "tensors": args.tensors,
        "rounds": args.rounds,
        "warmup": warm,
        "busy_trainer": not args.idle,
    }
    for kind, rs in rows.items():
        measures = ("call_s", "done_s") if args.idle else ("call_s", "done_s", "py_rate")
        out[kind] = {m: summary([r[m] for r in rs]) for m in measures}
        out[kind]["per_round"] = [{m: round(r[m], 4) for m in measures} for r in rs]
    if rank == 0:
        json.dump(out, sys.stdout, indent=1)
        print()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
