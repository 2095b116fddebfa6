"""Ranged DCP loads (issue 22 item 3): bytes read per rank and load time of
``ShmckptReader`` (only the tensors of each rank's load plan) against DCP's
``FileSystemReader`` on the same state, on W gloo ranks (CPU).

The state: replicated tensors (every rank holds all of them; DCP saves each once and
spreads them over the rank files) and sharded ones (DTensor ``Shard(0)``: each rank's shard
in its own file). Each rank needs every replicated byte and its own shards. It is saved
twice, by ``ShmckptWriter`` and by DCP's ``FileSystemWriter``, then loaded in alternated
rounds (page cache dropped before each load where possible). Per load and rank: wall time
of ``dcp.load``, the bytes the reader read (``ShmckptReader.last_read_io``; for
``FileSystemReader`` the lengths of the items of its plan, which it reads one by one),
and ``/proc/self/io`` deltas (``rchar``: read system calls, which io_uring reads do not
count; ``read_bytes``: bytes the block layer read for the process, every path). The
physical reference of the round: each rank reads its own shmckpt rank file with O_DIRECT
(16 MiB requests), all ranks at once; ``limit_s`` = the bytes a rank needs at that rate.

    python benches/python/pyb_ranged.py --total-mib 1024 --world 4 --rounds 5 \\
        --root /var/tmp/pyr --out /tmp/pyr-out

Writes OUT/pyb_ranged.json (every measurement) and OUT/pyb_ranged.md (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyb_common import Evictor, raw_read  # noqa: E402

MiB = 1 << 20


def pattern(k: int, nbytes: int) -> torch.Tensor:
    """A float32 tensor of `nbytes` whose bytes depend on `k` (cheap to make: a 1 MiB
    random block, rolled by `k`, repeated)."""
    g = torch.Generator().manual_seed(1234)
    block = torch.randint(-(2**31), 2**31 - 1, (MiB // 4,), generator=g, dtype=torch.int32).roll(k * 7919)
    n = nbytes // 4
    reps = (n + block.numel() - 1) // block.numel()
    return block.repeat(reps)[:n].clone().view(torch.float32)


def make_state(args: argparse.Namespace, mesh: Any, zero: bool) -> Dict[str, Any]:
    total = args.total_mib * MiB
    rep_bytes = int(total * args.replicated)
    shard_bytes = total - rep_bytes
    rep = {}
    for k in range(args.replicated_tensors):
        t = pattern(k, rep_bytes // args.replicated_tensors)
        rep[f"r{k}"] = torch.zeros_like(t) if zero else t
    sh = {}
    world = dist.get_world_size()
    for k in range(args.sharded_tensors):
        n = shard_bytes // args.sharded_tensors // 4
        rows = world * 256
        full = pattern(1000 + k, (n // rows) * rows * 4).reshape(rows, -1)
        sh[f"s{k}"] = distribute_tensor(torch.zeros_like(full) if zero else full, mesh, [Shard(0)])
    return {"rep": rep, "sharded": sh}


def same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    for k in a["rep"]:
        if not torch.equal(a["rep"][k].view(torch.int32), b["rep"][k].view(torch.int32)):
            return False
    for k in a["sharded"]:
        x, y = a["sharded"][k].to_local(), b["sharded"][k].to_local()
        if not torch.equal(x.view(torch.int32), y.view(torch.int32)):
            return False
    return True


def zero_(st: Dict[str, Any]) -> None:
    for t in st["rep"].values():
        t.zero_()
    for t in st["sharded"].values():
        t.to_local().zero_()


def proc_io() -> Dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


class CountingFSReader(FileSystemReader):
    """DCP's FileSystemReader, counting the bytes of the items of its plan (it reads each
    item's byte range)."""

    planned = 0

    def read_data(self, plan: Any, planner: Any) -> Any:
        self.planned = sum(self.storage_data[r.storage_index].length for r in plan.items)
        return super().read_data(plan, planner)


def files_of(d: str) -> List[str]:
    return sorted(os.path.join(d, f) for f in os.listdir(d) if not f.startswith(".") or f == ".metadata")


def rank_main(rank: int, args: argparse.Namespace) -> None:
    from shmckpt.dcp import ShmckptReader, ShmckptWriter, release

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.root}/store", rank=rank, world_size=args.world)
    mesh = init_device_mesh("cpu", (args.world,))
    src = make_state(args, mesh, zero=False)
    shm, fs = os.path.join(args.root, "shm"), os.path.join(args.root, "fs")
    t = time.perf_counter()
    dcp.save(src, storage_writer=ShmckptWriter(shm))
    t_shm = time.perf_counter() - t
    t = time.perf_counter()
    dcp.save(src, storage_writer=FileSystemWriter(fs))
    t_fs = time.perf_counter() - t
    release()
    own_file = os.path.join(shm, f"rank-{rank:05d}-of-{args.world:05d}.safetensors")
    dst = make_state(args, mesh, zero=True)
    ev = Evictor()
    rows: List[Dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = ["shmckpt", "dcp_fs"] if rnd % 2 == 0 else ["dcp_fs", "shmckpt"]
        for what in ["raw"] + order:
            if rank == 0:
                ev.evict(*files_of(shm), *files_of(fs))
            zero_(dst)
            dist.barrier()
            io0 = proc_io()
            t = time.perf_counter()
            row: Dict[str, Any] = {"round": rnd, "what": what, "rank": rank}
            if what == "raw":
                r = raw_read(own_file, 1)
                row.update(s=time.perf_counter() - t, bytes=os.path.getsize(own_file), direct=r["direct"])
            elif what == "shmckpt":
                reader = ShmckptReader(shm)
                dcp.load(dst, storage_reader=reader)
                row.update(s=time.perf_counter() - t, bytes=reader.last_read_io["bytes"], reads=reader.last_read_io["reads"])
            else:
                fsr = CountingFSReader(fs)
                dcp.load(dst, storage_reader=fsr)
                row.update(s=time.perf_counter() - t, bytes=fsr.planned)
            io1 = proc_io()
            row.update(rchar=io1["rchar"] - io0["rchar"], read_bytes=io1["read_bytes"] - io0["read_bytes"])
            if what != "raw" and (rnd == 0 or args.verify_all):
                row["exact"] = same(src, dst)
            rows.append(row)
            dist.barrier()
    gathered: List[Any] = [None] * args.world
    dist.all_gather_object(gathered, {"rows": rows, "save_s": {"shmckpt": t_shm, "dcp_fs": t_fs}, "evict": ev.record()})
    if rank == 0:
        write(args, gathered, shm, fs)
    dist.destroy_process_group()


def need_bytes(shm: str, world: int) -> Dict[str, Any]:
    """From the shmckpt checkpoint's metadata: data bytes per file, sharded bytes per file,
    and the bytes each rank needs (everything but the other ranks' shards)."""
    from shmckpt.dcp import ShmckptReader

    md = ShmckptReader(shm).read_metadata()
    per_file: Dict[str, int] = {}
    shards: Dict[str, int] = {}
    reps: Dict[str, int] = {}
    for idx, info in md.storage_data.items():
        per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
        if idx.fqn.startswith("sharded."):
            shards[info.relative_path] = shards.get(info.relative_path, 0) + info.length
        elif idx.fqn.startswith("rep."):
            reps[info.relative_path] = reps.get(info.relative_path, 0) + 1
    total = sum(per_file.values())
    files = [f"rank-{k:05d}-of-{world:05d}.safetensors" for k in range(world)]
    need = [total - sum(v for f, v in shards.items() if f != files[r]) for r in range(world)]
    return {"total": total, "per_file": per_file, "shards": shards, "replicated_per_file": reps, "need": need}


def summary(xs: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def write(args: argparse.Namespace, gathered: List[Any], shm: str, fs: str) -> None:
    rows = [r for g in gathered for r in g["rows"]]
    need = need_bytes(shm, args.world)
    out: Dict[str, Any] = {"args": vars(args), "need": need, "save_s": [g["save_s"] for g in gathered], "evict": gathered[0]["evict"], "rows": rows}
    # Per round: the slowest rank's time (the load ends when every rank has loaded), and
    # per rank the bytes read.
    res: Dict[str, Any] = {}
    raw = {(r["round"], r["rank"]): r for r in rows if r["what"] == "raw"}
    for what in ("shmckpt", "dcp_fs", "raw"):
        sel = [r for r in rows if r["what"] == what]
        slowest = [max(r["s"] for r in sel if r["round"] == k) for k in range(args.rounds)]
        ratio = []
        for k in range(args.rounds):
            worst = 0.0
            for r in (x for x in sel if x["round"] == k):
                rr = raw[(k, r["rank"])]
                limit = need["need"][r["rank"]] / (rr["bytes"] / rr["s"])
                worst = max(worst, r["s"] / limit)
            ratio.append(worst)
        res[what] = {
            "slowest_rank_s": summary(slowest),
            "ratio_to_limit": summary(ratio),
            "bytes_per_rank": [statistics.median([r["bytes"] for r in sel if r["rank"] == k]) for k in range(args.world)],
            "read_bytes_per_rank": [statistics.median([r["read_bytes"] for r in sel if r["rank"] == k]) for k in range(args.world)],
            "exact": all(r.get("exact", True) for r in sel),
        }
    out["summary"] = res
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pyb_ranged.json"), "w") as f:
        json.dump(out, f, indent=1)
    mib = lambda b: f"{b / MiB:.1f}"  # noqa: E731
    lines = [
        f"{args.world} gloo ranks, {args.total_mib} MiB state ({args.replicated:.0%} replicated in "
        f"{args.replicated_tensors} tensors, the rest sharded in {args.sharded_tensors}); "
        f"a rank needs {mib(need['need'][0])} MiB of {mib(need['total'])} MiB; {args.rounds} alternated rounds; "
        f"page cache dropped: drop_caches {out['evict']['drop_caches_ok']}, fadvise {out['evict']['fadvise_dontneed_ok']}",
        "",
        "× limit: the slowest rank's load time over (bytes it needs / its raw O_DIRECT read rate in the same round, "
        "all ranks reading at once). MiB read: what the reader read (FileSystemReader: its plan's item lengths); "
        "from disk: /proc/self/io read_bytes (buffered reads of a file another rank just read come from the page cache).",
        "",
        "| reader | slowest rank s, median (min–max) | × limit, median (min–max) | MiB read per rank (reader) | MiB from disk per rank (read_bytes) | exact |",
        "|---|---|---|---|---|---|",
    ]
    for what, label in (("shmckpt", "ShmckptReader (ranged)"), ("dcp_fs", "DCP FileSystemReader"), ("raw", "raw O_DIRECT read of own rank file")):
        s = res[what]
        t, q = s["slowest_rank_s"], s["ratio_to_limit"]
        ratio_cell = "—" if what == "raw" else f"{q['median']:.2f} ({q['min']:.2f}–{q['max']:.2f})"
        exact_cell = "—" if what == "raw" else str(s["exact"])
        lines.append(
            f"| {label} | {t['median']:.3f} ({t['min']:.3f}–{t['max']:.3f}) | {ratio_cell} | "
            f"{', '.join(mib(b) for b in s['bytes_per_rank'])} | {', '.join(mib(b) for b in s['read_bytes_per_rank'])} | {exact_cell} |"
        )
    with open(os.path.join(args.out, "pyb_ranged.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--replicated", type=float, default=0.5, help="fraction of the bytes replicated")
    p.add_argument("--replicated-tensors", type=int, default=32)
    p.add_argument("--sharded-tensors", type=int, default=16)
    p.add_argument("--verify-all", action="store_true", help="check every load byte-exact (not only round 0)")
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.root = os.path.abspath(args.root)
    if os.path.exists(args.root):
        shutil.rmtree(args.root)
    os.makedirs(args.root)
    try:
        mp.spawn(rank_main, args=(args,), nprocs=args.world, join=True)
    finally:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
