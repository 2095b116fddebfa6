"""Megatron-Core 0.19 ``--async-save`` with NVRx against shmckpt, one process per run.

Each system runs in a fresh process of its own (one GPU, NCCL), alternated over rounds,
so that what a save leaves on the device is measured by the driver's count against a
process that never saved (``none``) in the same setup:

- ``none``: the same training and offload, no save;
- ``shmckpt``: ``shmckpt.megatron.ShmckptSaveShardedStrategy`` with NVRx's persistent
  ``AsyncCallsQueue(cpu_shm_mode=True)`` (its worker makes no CUDA context);
- ``nvrx-shm``: ``TorchDistSaveShardedStrategy(cpu_shm_mode=True)`` with
  ``AsyncCallsQueue(cpu_shm_mode=True)`` (NVRx ``use_cpu_shm_for_gpu_tensors``: the
  trainer copies every tensor into CPU shared memory, the persistent worker writes it);
- ``nvrx-shm-cached``: the same with ``cached_metadata=True`` (Megatron-LM's
  ``--ckpt-assume-constant-structure``): the shared-memory copies are reused by every save;
- ``nvrx-ipc``: ``TorchDistSaveShardedStrategy()`` with ``AsyncCallsQueue()``, NVRx's
  default: GPU tensors sent to the persistent worker by CUDA IPC, copied there.

All save with ``async_strategy="nvrx"`` (0.19's default). Every process: CUDA context,
one NCCL all-reduce (the communicator a multi-GPU trainer has anyway), a megatron-core
GPT (local layer spec, fp32 weights, bf16 autocast, Adam) trained a few steps; then a
warm-up save (not recorded: arenas, workers) and ``--saves`` recorded ones, training on
and polling the queue after each step as Megatron-LM does. Per save: ``stall_s``
(``dist_checkpointing.save`` + ``schedule_async_request`` + ``torch.cuda.synchronize``),
``durable_s`` (until the queue finalized it), and host memory once finalized (the
trainer's and its child processes' RSS, ``/dev/shm`` in use, and the machine's
``MemTotal - MemAvailable``). Per process, after the last save is finalized: the model
and the optimizer state moved to the CPU, ``gc.collect()``, ``torch.cuda.empty_cache()``,
then the device memory in use by the driver's count (``torch.cuda.mem_get_info``: all
processes) and torch's ``memory_reserved``; the shmckpt process also records the driver's
count after each step of its own set-up (engine opened, arena registered with CUDA, first
save staged, finalized) and after ``shmckpt.dcp.release()``.

    python3 benches/megatron/nvrx_compare.py --save-dir /var/tmp/mb --layers 8 \\
        --hidden 2048 --rounds 2 --saves 4 --out nvrx.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, List

GIB = float(1 << 30)


def used_device() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def host_memory() -> Dict[str, int]:
    import psutil

    me = psutil.Process()
    kids = me.children(recursive=True)
    rss_kids = 0
    for k in kids:
        try:
            rss_kids += k.memory_info().rss
        except psutil.Error:
            pass
    mi = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            mi[k] = int(v.split()[0]) * 1024
    return {
        "rss_trainer": int(me.memory_info().rss),
        "rss_children": int(rss_kids),
        "children": len(kids),
        "dev_shm": int(shutil.disk_usage("/dev/shm").used),
        "machine_used": int(mi["MemTotal"] - mi["MemAvailable"]),
    }


def child(args: argparse.Namespace) -> Dict[str, Any]:
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist

    system = args.child
    out: Dict[str, Any] = {"system": system, "phases": {}}
    phases = out["phases"]
    t_start = time.perf_counter()
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    phases["context"] = used_device()
    dist.init_process_group("nccl", rank=0, world_size=1)
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    phases["nccl"] = used_device()

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    import megatron.core

    out["megatron_core"] = megatron.core.__version__
    import nvidia_resiliency_ext

    out["nvrx"] = getattr(nvidia_resiliency_ext, "__version__", "?")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=max(1, args.hidden // 128),
        params_dtype=torch.float32,
    )
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    g = torch.Generator(device="cuda").manual_seed(7)
    pos = torch.arange(args.seq, device="cuda").unsqueeze(0).expand(args.batch, -1)
    mask = torch.triu(torch.ones(1, 1, args.seq, args.seq, device="cuda", dtype=torch.bool), diagonal=1)

    def step() -> None:
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, pos, mask, labels=ids).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out["param_bytes"] = param_bytes
    phases["trained"] = used_device()

    strategy: Any = None
    queue: Any = None
    if system == "shmckpt":
        import shmckpt.dcp
        import shmckpt.megatron as smg

        out["shmckpt_megatron"] = smg.MEGATRON_VERSION
        # The engine's set-up step by step (what shmckpt's first save would otherwise do
        # inside it): arena opened, then registered with CUDA (engine stream, pinning).
        # (The checkpoints go to save_dir/shmckpt/iter_N: their spool is that parent's.)
        cap = param_bytes + (64 << 20)
        parent = os.path.join(args.save_dir, system)
        r = shmckpt.dcp.prepare(parent, staging_capacity=cap, devices=[])
        phases["shmckpt_engine_open"] = used_device()
        r = shmckpt.dcp.prepare(parent, staging_capacity=cap, devices=[0])
        torch.cuda.synchronize()
        phases["shmckpt_registered"] = used_device()
        out["prepare"] = r
        strategy = smg.ShmckptSaveShardedStrategy()
        queue = AsyncCallsQueue(persistent=True, cpu_shm_mode=True)
    elif system == "nvrx-shm":
        strategy = TorchDistSaveShardedStrategy(cpu_shm_mode=True)
        queue = AsyncCallsQueue(persistent=True, cpu_shm_mode=True)
    elif system == "nvrx-shm-cached":
        # Megatron-LM's --ckpt-assume-constant-structure: the shm copies are kept and
        # reused by every later save (the worker keeps its references).
        strategy = TorchDistSaveShardedStrategy(cpu_shm_mode=True, cached_metadata=True)
        queue = AsyncCallsQueue(persistent=True, cpu_shm_mode=True)
    elif system == "nvrx-ipc":
        strategy = TorchDistSaveShardedStrategy()
        queue = AsyncCallsQueue(persistent=True)
    elif system != "none":
        raise SystemExit(f"unknown system {system}")

    rec: Dict[str, List[float]] = {}
    steps_per_save: List[int] = []
    for n in range(args.saves + 1):  # save 0: warm-up (not recorded)
        if strategy is None:
            # No save: the same training between "saves".
            for _ in range(args.none_steps):
                step()
            torch.cuda.synchronize()
            if n > 0:
                for k, v in host_memory().items():
                    rec.setdefault(f"host_{k}", []).append(float(v))
            continue
        d = os.path.join(args.save_dir, system, f"iter_{n:07d}")
        os.makedirs(d)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        req = dist_checkpointing.save(
            {"model": model.sharded_state_dict()}, d, strategy, async_sharded_save=True, async_strategy="nvrx"
        )
        queue.schedule_async_request(req)
        torch.cuda.synchronize()
        stall = time.perf_counter() - t0
        if n == 0 and system == "shmckpt":
            phases["shmckpt_first_save_staged"] = used_device()
        # (NVRx 0.7's maybe_finalize_async_calls returns 0 for every call: count instead.)
        k = 0
        while queue.get_num_unfinalized_calls():
            step()
            k += 1
            queue.maybe_finalize_async_calls(blocking=False)
        durable = time.perf_counter() - t0
        if n == 0 and system == "shmckpt":
            torch.cuda.synchronize()
            phases["shmckpt_first_save_finalized"] = used_device()
        if n > 0:
            rec.setdefault("stall_s", []).append(stall)
            rec.setdefault("durable_s", []).append(durable)
            steps_per_save.append(k)
            for key, v in host_memory().items():
                rec.setdefault(f"host_{key}", []).append(float(v))
        shutil.rmtree(d)
    out["steps_per_save"] = steps_per_save
    torch.cuda.synchronize()
    phases["after_saves"] = used_device()
    # Offload the model and the optimizer state, give the cache back.
    model.cpu()
    for st in opt.state.values():
        for k2, v in list(st.items()):
            if torch.is_tensor(v):
                st[k2] = v.cpu()
    opt.zero_grad(set_to_none=True)
    del pos, mask, g
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    time.sleep(1.0)
    phases["offloaded"] = used_device()
    out["offloaded_torch_reserved"] = int(torch.cuda.memory_reserved())
    out["offloaded_torch_allocated"] = int(torch.cuda.memory_allocated())
    out["offloaded_host"] = host_memory()
    if queue is not None:
        queue.close()
    if system == "shmckpt":
        import shmckpt.dcp

        shmckpt.dcp.release()
        torch.cuda.synchronize()
        phases["shmckpt_released"] = used_device()
    gc.collect()
    torch.cuda.empty_cache()
    phases["closed"] = used_device()
    out["rec"] = rec
    out["wall_s"] = time.perf_counter() - t_start
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def summary(xs: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--saves", type=int, default=3, help="recorded saves per process (after one warm-up)")
    ap.add_argument("--none-steps", type=int, default=10, help="training steps per 'save' of the no-save run")
    ap.add_argument("--systems", default="none,shmckpt,nvrx-shm,nvrx-shm-cached,nvrx-ipc")
    ap.add_argument("--out", default=None, help="JSON results (rewritten after every process)")
    ap.add_argument("--deadline-s", type=float, default=0, help="start no process after this many seconds")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = child(args)
        with open(args.child_out, "w") as f:
            json.dump(res, f)
        return

    systems = args.systems.split(",")
    runs: List[Dict[str, Any]] = []
    t0 = time.perf_counter()
    port = 29600
    for rnd in range(args.rounds):
        order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
        for s in order:
            if args.deadline_s and time.perf_counter() - t0 > args.deadline_s:
                print(f"deadline: not starting {s} of round {rnd}", flush=True)
                continue
            shutil.rmtree(args.save_dir, ignore_errors=True)
            os.makedirs(args.save_dir)
            port += 1
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
            res_path = os.path.join(args.save_dir + f"-{s}-{rnd}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", s, "--child-out", res_path]
            for k in ("save_dir", "layers", "hidden", "vocab", "seq", "batch", "saves", "none_steps"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            ts = time.perf_counter()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{s} round {rnd} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}", flush=True)
                runs.append({"system": s, "round": rnd, "error": p.returncode})
                continue
            with open(res_path) as f:
                r = json.load(f)
            os.unlink(res_path)
            r["round"] = rnd
            runs.append(r)
            ph = r["phases"]
            print(
                f"round {rnd} {s}: {time.perf_counter() - ts:.1f} s; device used after offload "
                f"{ph['offloaded'] / GIB:.3f} GiB (torch reserved {r['offloaded_torch_reserved'] / GIB:.3f}); "
                + ", ".join(f"{k} {summary(v)['median']:.3f}" for k, v in r["rec"].items() if k.endswith("_s")),
                flush=True,
            )
            report = {"args": {k: v for k, v in vars(args).items() if not k.startswith("child")}, "runs": runs}
            report["summary"] = summarize(runs)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
    print(json.dumps(summarize(runs), indent=1))


def summarize(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    by: Dict[str, List[Dict[str, Any]]] = {}
    for r in runs:
        if "error" not in r:
            by.setdefault(r["system"], []).append(r)
    base = by.get("none", [])
    base_dev = statistics.median([r["phases"]["offloaded"] for r in base]) if base else None
    base_host = statistics.median([v for r in base for v in r["rec"].get("host_machine_used", [])]) if base else None
    out: Dict[str, Any] = {}
    for s, rs in by.items():
        o: Dict[str, Any] = {"processes": len(rs)}
        for key in ("stall_s", "durable_s", "host_rss_trainer", "host_rss_children", "host_dev_shm", "host_machine_used"):
            xs = [v for r in rs for v in r["rec"].get(key, [])]
            if xs:
                o[key] = summary(xs)
        dev = [r["phases"]["offloaded"] for r in rs]
        o["device_used_offloaded_GiB"] = summary([v / GIB for v in dev])
        o["torch_reserved_offloaded_GiB"] = summary([r["offloaded_torch_reserved"] / GIB for r in rs])
        if base_dev is not None:
            o["device_vs_none_GiB"] = summary([(v - base_dev) / GIB for v in dev])
        if base_host is not None and "host_machine_used" in o:
            o["host_vs_none_GiB"] = summary(
                [(v - base_host) / GIB for r in rs for v in r["rec"].get("host_machine_used", [])]
            )
        keys = sorted({k for r in rs for k in r["phases"]})
        o["phases_GiB"] = {k: summary([r["phases"][k] / GIB for r in rs if k in r["phases"]]) for k in keys}
        out[s] = o
    return out


if __name__ == "__main__":
    sys.exit(main())
