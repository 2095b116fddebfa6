"""A complete training loop with shmckpt: non-blocking saves under ``guard``, resume after
a crash, bit for bit.

    python examples/train.py --ckpt /tmp/run1 --steps 200 --every 20
    # kill it (Ctrl-C, SIGKILL, a node failure), run the same command again: it resumes from
    # the newest committed checkpoint and continues exactly as if it had never stopped.

Runs on one GPU when there is one (``--device cuda``), else on the CPU. The model is a
small MLP on synthetic data so the example runs anywhere in seconds; the checkpointing is
what a real trainer writes. ``--loss-log FILE`` appends one line per step (``step loss`` with
the loss as a float hex, exact) and a ``final`` line with a digest of the weights and
optimizer state; ``--kill-at STEP`` SIGKILLs the process right after that step's save
call (the test in python/tests/test_examples.py uses both). ``--remote s3://bucket/prefix``
mirrors every checkpoint to a bucket: with the local disk lost, the same command resumes
from the bucket's newest step.
"""

import argparse
import hashlib
import os
import signal

import torch

import shmckpt


def batch(step: int, device: torch.device):
    """The data of a step: a function of the step only, so a resumed run sees the same."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True)).tanh()
    return x.to(device), y.to(device)


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of every weight and optimizer-state tensor, bytes as they are."""
    h = hashlib.sha256()
    tensors = list(model.state_dict().values())
    for st in opt.state_dict()["state"].values():
        tensors += [st[k] for k in sorted(st)]
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint root (created if missing)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20, help="save every N steps")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--loss-log", help="append per-step losses and the final digest here")
    ap.add_argument("--remote", help="also mirror every checkpoint to this bucket (s3://bucket/prefix)")
    ap.add_argument("--kill-at", type=int, help="SIGKILL this process right after saving this step")
    a = ap.parse_args()
    dev = torch.device(a.device)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 1)
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)

    # recover_on_open: a save that was fully staged when the previous process died is
    # committed (and its shared memory freed) before we look for the latest checkpoint.
    ckpt = shmckpt.Checkpointer(a.ckpt, keep_last=3, recover_on_open=True, remote=a.remote)
    ckpt.guard(opt)  # opt.step() waits for a save still copying the weights

    start = 0
    # latest(): the step load("latest") loads (memory, the local disk, else the bucket),
    # so a run whose local disk was lost resumes from the bucket.
    if (last := ckpt.latest()) is not None:
        state = ckpt.load(last)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"]["cpu"])
        if dev.type == "cuda":
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        start = state["step"] + 1
        print(f"resumed from step {state['step']}", flush=True)

    log = open(a.loss_log, "a") if a.loss_log else None
    pending = None
    for step in range(start, a.steps):
        x, y = batch(step, dev)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()  # waits here only if a save is still copying
        opt.zero_grad(set_to_none=True)
        sched.step()
        if log:
            log.write(f"{step} {loss.item().hex()}\n")
            log.flush()
        if step % a.every == 0 or step == a.steps - 1:
            if pending is not None:
                pending.wait()  # surfaces an error of the previous save (normally long done)
            rng = {"cpu": torch.get_rng_state()}
            if dev.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state_all()
            pending = ckpt.save(
                step,
                {"model": model.state_dict(), "optim": opt.state_dict(),
                 "sched": sched.state_dict(), "rng": rng, "step": step},
                blocking=False,
            )
            if a.kill_at == step:
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()  # waits for the last save to be committed
    if log:
        log.write(f"final {digest(model, opt)}\n")
        log.close()


if __name__ == "__main__":
    main()
