"""Megatron-Core ``--async-save``: Megatron's own torch_dist path against shmckpt's.

Trains a megatron-core GPT (local layer spec, no TransformerEngine) on the GPUs of one
machine (``torchrun --nproc-per-node N``, or plain ``python`` for one GPU) and saves it
asynchronously through Megatron's ``AsyncCallsQueue`` with each system in turn,
alternating rounds:

- ``mcore``: ``TorchDistSaveShardedStrategy`` with Megatron's forking
  ``TemporalAsyncCaller`` (its ``preload_fn`` copies the GPU tensors to host memory in the
  trainer, then a forked child writes them with ``FileSystemWriterAsync``);
- ``mcore-persistent``: the same strategy with Megatron's persistent worker
  (``--use-persistent-ckpt-worker``: the request, GPU tensors included, is pickled to a
  spawned worker, i.e. CUDA IPC, and the worker copies them to host memory);
- ``shmckpt``: ``shmckpt.megatron.ShmckptSaveShardedStrategy`` (forking caller).

Per save it records, on every rank: ``stall_s`` (the trainer blocked in
``dist_checkpointing.save`` + ``schedule_async_request``, then
``torch.cuda.synchronize``), ``durable_s`` (from the save call until Megatron's finalize
returned it, training on meanwhile and polling the queue after each step, as Megatron-LM
does), ``reserved_delta`` / ``allocated_delta`` (device memory right after the call
minus right before it) and ``held_allocated`` (allocated device memory after the save is
finalized and one more training step, minus before the save). The physical limit is
measured in the same run: ``disk_s``, writing and ``fsync``ing as many bytes as a rank
file to the same filesystem, between rounds. Prints and writes (``--out``) medians with
min and max per system.

    torchrun --nproc-per-node 1 benches/megatron/async_save.py --save-dir /mnt/ckpt/bench \\
        --layers 24 --hidden 2048 --rounds 5

``--cpu-smoke`` runs the same loop on CPU with gloo (weights perturbed instead of a
forward pass, Megatron's two hard-coded CUDA calls pointed at the CPU as in the tests):
for checking the driver, not for numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def build(args: argparse.Namespace, device: str) -> torch.nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1)
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=max(1, args.hidden // 128),
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16 if device == "cuda" else torch.float32,
        bf16=device == "cuda",
    )
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq
    )
    return model.to(device)


def disk_limit(path: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` (1 MiB writes) and fsync them at ``path``."""
    buf = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            n = min(left, len(buf))
            f.write(buf[:n])
            left -= n
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


def summary(xs: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--systems", default="mcore,mcore-persistent,shmckpt")
    ap.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()

    cpu = args.cpu_smoke
    if cpu:
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world)

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    import shmckpt.megatron as smg

    parallel_state.initialize_model_parallel(1, 1)
    device = "cpu" if cpu else "cuda"
    model = build(args, device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    g = torch.Generator(device=device).manual_seed(7 + rank)
    pos = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.batch, -1)
    mask = torch.triu(torch.ones(1, 1, args.seq, args.seq, device=device, dtype=torch.bool), diagonal=1)

    def step() -> None:
        if cpu:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            return
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=g)
        loss = model(ids, pos, mask, labels=ids).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    systems = args.systems.split(",")
    queues = {s: AsyncCallsQueue(persistent=(s == "mcore-persistent")) for s in systems}
    strategies: Dict[str, Any] = {
        "mcore": TorchDistSaveShardedStrategy("torch_dist", 1),
        "mcore-persistent": TorchDistSaveShardedStrategy("torch_dist", 1),
        "shmckpt": smg.ShmckptSaveShardedStrategy(),
    }
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results: Dict[str, Dict[str, List[float]]] = {s: {} for s in systems + ["disk"]}
    for _ in range(3):
        step()
    n = 0
    for rnd in range(args.rounds + 1):  # round 0: warm-up (engine arenas, allocator), not recorded
        order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
        for s in order:
            d = os.path.join(args.save_dir, s, f"iter_{n:07d}")
            n += 1
            if rank == 0:
                os.makedirs(d)
            dist.barrier()
            q = queues[s]
            if not cpu:
                torch.cuda.synchronize()
            r0, a0 = (0, 0) if cpu else (torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
            t0 = time.perf_counter()
            req = dist_checkpointing.save(
                {"model": model.sharded_state_dict()}, d, strategies[s], async_sharded_save=True
            )
            idx = q.schedule_async_request(req)
            if not cpu:
                torch.cuda.synchronize()
            stall = time.perf_counter() - t0
            r1, a1 = (0, 0) if cpu else (torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
            done: List[int] = []
            while idx not in done:
                step()
                done += q.maybe_finalize_async_calls(blocking=False)
            durable = time.perf_counter() - t0
            step()
            held = 0 if cpu else torch.cuda.memory_allocated() - a0
            if rnd > 0:
                rec = results[s]
                for k, v in (
                    ("stall_s", stall),
                    ("durable_s", durable),
                    ("reserved_delta", r1 - r0),
                    ("allocated_delta", a1 - a0),
                    ("held_allocated", held),
                ):
                    rec.setdefault(k, []).append(float(v))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d)
        if rnd > 0:
            rank_bytes = param_bytes // world
            results["disk"].setdefault("disk_s", []).append(
                disk_limit(os.path.join(args.save_dir, f"disk-{rank}.bin"), rank_bytes)
            )
            dist.barrier()
    for q in queues.values():
        q.close()
    out = {
        "world": world,
        "param_bytes": param_bytes,
        "args": vars(args),
        "device": "cpu" if cpu else torch.cuda.get_device_name(),
        "per_rank": {},
    }
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, {s: {k: summary(v) for k, v in m.items()} for s, m in results.items()})
    out["per_rank"] = {str(r): g_ for r, g_ in enumerate(gathered)}
    if rank == 0:
        text = json.dumps(out, indent=1)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
