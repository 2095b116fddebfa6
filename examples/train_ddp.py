"""The training loop of train.py on several processes (DistributedDataParallel), launched
with torchrun: each rank saves its own file of every checkpoint, non-blocking under
``guard``, and the step is committed when every rank's file is durable.

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --ckpt /tmp/run2
    # kill it, run the same command again: every rank resumes from the newest step that
    # all ranks committed, bit for bit.

gloo on the CPU (the default without GPUs), NCCL with one GPU per rank (``--device cuda``).
``--loss-log PREFIX`` appends ``PREFIX.rank<R>`` lines as train.py does; ``--kill-at STEP`` makes
rank ``--kill-rank`` (default 1) SIGKILL itself right after that step's save call, and
torchrun then stops the other ranks (python/tests/test_examples.py).
"""

import argparse
import hashlib
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import shmckpt


def batch(step: int, rank: int, device: torch.device):
    """This rank's data of a step: a function of (step, rank) only."""
    g = torch.Generator().manual_seed(1000 + 7919 * rank + step)
    x = torch.randn(16, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True)).tanh()
    return x.to(device), y.to(device)


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    tensors = list(model.state_dict().values())
    for st in opt.state_dict()["state"].values():
        tensors += [st[k] for k in sorted(st)]
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint root shared by the ranks (created if missing)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20, help="save every N steps")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--loss-log", help="append per-step losses and the final digest to PREFIX.rank<R>")
    ap.add_argument("--kill-at", type=int, help="SIGKILL rank --kill-rank right after saving this step")
    ap.add_argument("--kill-rank", type=int, default=1)
    a = ap.parse_args()

    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    rank = dist.get_rank()
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 1)
    ).to(dev)
    model = DDP(net, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)

    # Rank and world size come from torch.distributed; the constructor ends with a barrier
    # (every rank's engine is open, and has recovered what its dead predecessor staged,
    # before any rank looks for the latest step or saves).
    ckpt = shmckpt.Checkpointer(a.ckpt, keep_last=3, recover_on_open=True)
    ckpt.guard(opt)

    start = 0
    if (last := ckpt.latest()) is not None:
        state = ckpt.load(last)  # this rank's file
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"]["cpu"])
        start = state["step"] + 1
        if rank == 0:
            print(f"resumed from step {state['step']}", flush=True)

    log = open(f"{a.loss_log}.rank{rank}", "a") if a.loss_log else None
    pending = None
    for step in range(start, a.steps):
        x, y = batch(step, rank, dev)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # gradients averaged across ranks
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if log:
            log.write(f"{step} {loss.item().hex()}\n")
            log.flush()
        if step % a.every == 0 or step == a.steps - 1:
            if pending is not None:
                pending.wait()
            pending = ckpt.save(
                step,
                {"model": net.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                 "rng": {"cpu": torch.get_rng_state()}, "step": step},
                blocking=False,
            )
            if a.kill_at == step and rank == a.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()  # this rank's file is durable
    dist.barrier()  # ... and every rank's: the last step is committed
    if log:
        log.write(f"final {digest(net, opt)}\n")
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
