#!/usr/bin/env python3
"""DCP async_save: DefaultStager + process writer against ShmckptWriter (and shmckpt's
native Python path as the reference), on one GPU.

For each mode and save: the trainer's stall (until async_save returns, and until the
state is staged, i.e. may be changed), time to durable (the checkpoint complete on disk),
host memory (RSS of this process and its children, /dev/shm in use) and device memory
(allocated / reserved change across the save).

    python benches/dcp/dcp_bench.py --dir /mnt/nvme/dcp-bench --gib 8 --tensors 64 --saves 4
    torchrun --nproc-per-node 2 benches/dcp/dcp_bench.py --dir ... (one GPU per rank)

Needs torch with CUDA and the shmckpt package (``pip install ./python``). Modes:
``default`` = ``dcp.async_save(sd, storage_writer=FileSystemWriter(p),
async_stager=DefaultStager(StagingOptions(True, True, True, True)),
async_checkpointer_type=PROCESS)`` (DCP's recommended fast path: pinned shared-memory
staging on a side stream, a writer process; a new stager per save, because torch 2.11's
cannot stage twice);
``shmckpt`` = ``dcp.async_save(sd, storage_writer=ShmckptWriter(p))``; ``native`` =
``shmckpt.Checkpointer(dir).save(step, sd)`` then ``wait()`` (the goal is DCP-through-
shmckpt within 1.10x of it). The first save of each mode is warm-up (process start,
arena creation and registration) and is reported separately.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

warnings.filterwarnings("ignore")


def rss_tree(pid=None):
    """RSS bytes of a process and all its descendants."""
    pid = pid or os.getpid()
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for c in f.read().split():
                    total += rss_tree(int(c))
    except FileNotFoundError:
        pass
    return total


def shm_used():
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def make_state(gib, n, device):
    per = int(gib * (1 << 30)) // n // 2  # bf16 elements per tensor
    g = torch.Generator(device=device).manual_seed(0)
    return {
        "model": {f"layer{i}.weight": torch.randn(per, device=device, dtype=torch.float32, generator=g).to(torch.bfloat16) for i in range(n)},
        "step": 0,
    }


def init_dist(cpu=False):
    backend = "gloo" if cpu else "cpu:gloo,cuda:nccl"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rank = dist.get_rank()
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return rank, dist.get_world_size()


def bench_mode(mode, args, sd, rank):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    base = os.path.join(args.dir, mode)
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
    dist.barrier()
    rows = []
    stager = None
    ck = None
    rss0, shm0 = rss_tree(), shm_used()  # before any stager, arena or writer process
    new_stager = None
    if mode == "default":
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # A new stager per save: torch 2.11's DefaultStager._stage() closes its
            # StateDictStager, and a second stage() on it raises KeyError (see
            # benches/anchors/README.md). So DCP pins a fresh buffer every save, as
            # trainers on 2.11 get it.
            def new_stager():
                return DefaultStager(StagingOptions(True, True, True, True))
        except ImportError:  # torch < 2.9: FileSystemWriter stages itself (below)
            new_stager = None
    if mode == "native":
        import shmckpt

        ck = shmckpt.Checkpointer(base, keep_last=1, tuning=shmckpt.Tuning(staging_capacity=int(args.gib * (1 << 30) / args.world) + (256 << 20)))
    for i in range(args.saves):
        path = os.path.join(base, f"step-{i}")
        sd["step"] = i
        torch.cuda.synchronize()
        dist.barrier()
        alloc0, res0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        if mode == "default" and new_stager is not None:
            if stager is not None:
                stager.close()
            stager = new_stager()
            resp = dcp.async_save(
                sd,
                storage_writer=dcp.FileSystemWriter(path),
                async_stager=stager,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
        elif mode == "default":
            resp = dcp.async_save(
                sd,
                storage_writer=dcp.FileSystemWriter(path, cache_staged_state_dict=True),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
        elif mode == "shmckpt":
            from shmckpt.dcp import ShmckptWriter

            resp = dcp.async_save(sd, storage_writer=ShmckptWriter(path))
        else:
            h = ck.save(i, sd, blocking=True)
            resp = None
        t_return = time.perf_counter() - t0
        if resp is not None and hasattr(resp, "staging_completion"):
            resp.staging_completion.result()
        t_staged = time.perf_counter() - t0
        alloc1, res1 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        if resp is None:
            h.wait()
        else:
            (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
        t_durable = time.perf_counter() - t0
        dist.barrier()
        rss1, shm1 = rss_tree(), shm_used()
        rows.append(
            {
                "mode": mode,
                "save": i,
                "return_s": t_return,
                "staged_s": t_staged,
                "durable_s": t_durable,
                "rss_growth_gib": (rss1 - rss0) / (1 << 30),
                "shm_growth_gib": (shm1 - shm0) / (1 << 30),
                "dev_alloc_delta": alloc1 - alloc0,
                "dev_reserved_delta": res1 - res0,
            }
        )
        if rank == 0 and mode != "native" and i > 0:
            shutil.rmtree(os.path.join(base, f"step-{i - 1}"), ignore_errors=True)
    if stager is not None:
        stager.close()
    if ck is not None:
        ck.close()
    if mode == "shmckpt":
        from shmckpt.dcp import release

        release()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="checkpoint directory (a real disk, not tmpfs)")
    ap.add_argument("--gib", type=float, default=8.0, help="state size over all ranks (GiB)")
    ap.add_argument("--tensors", type=int, default=64, help="tensors per rank")
    ap.add_argument("--saves", type=int, default=4, help="saves per mode (the first is warm-up)")
    ap.add_argument("--modes", default=None, help="comma list of default,shmckpt,native (default: all; with --cpu: shmckpt,native)")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--cpu", action="store_true", help="smoke run without a GPU (modes shmckpt,native)")
    args = ap.parse_args()
    if args.modes is None:
        args.modes = "shmckpt,native" if args.cpu else "default,shmckpt,native"
    if args.cpu:
        torch.cuda.synchronize = lambda *a: None
        torch.cuda.memory_allocated = torch.cuda.memory_reserved = lambda *a: 0
    rank, args.world = init_dist(args.cpu)
    sd = make_state(args.gib / args.world, args.tensors, torch.device("cpu" if args.cpu else "cuda"))
    torch.cuda.synchronize()
    rows = []
    for mode in args.modes.split(","):
        rows += bench_mode(mode, args, sd, rank)
    if rank == 0:
        print(f"state: {args.gib} GiB over {args.world} rank(s), {args.tensors} bf16 tensors per rank; torch {torch.__version__}")
        print(f"{'mode':8} {'save':>4} {'return s':>9} {'staged s':>9} {'durable s':>10} {'RSS +GiB':>9} {'shm +GiB':>9} {'dev alloc':>10} {'dev resv':>10}")
        for r in rows:
            print(
                f"{r['mode']:8} {r['save']:>4} {r['return_s']:9.3f} {r['staged_s']:9.3f} {r['durable_s']:10.3f} "
                f"{r['rss_growth_gib']:9.2f} {r['shm_growth_gib']:9.2f} {r['dev_alloc_delta']:10d} {r['dev_reserved_delta']:10d}"
            )
        print("median after warm-up:")
        for mode in args.modes.split(","):
            rs = [r for r in rows if r["mode"] == mode and r["save"] > 0] or [r for r in rows if r["mode"] == mode]
            med = {k: statistics.median(r[k] for r in rs) for k in ("return_s", "staged_s", "durable_s")}
            print(f"  {mode:8} return {med['return_s']:.3f} s  staged {med['staged_s']:.3f} s  durable {med['durable_s']:.3f} s  "
                  f"RSS +{max(r['rss_growth_gib'] for r in rs):.2f} GiB  shm +{max(r['shm_growth_gib'] for r in rs):.2f} GiB")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
