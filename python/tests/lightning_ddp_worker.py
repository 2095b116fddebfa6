"""Started by test_lightning.py under torchrun (2 CPU processes, gloo): trains a small
LightningModule with DDP and ShmckptCheckpointIO, optionally resuming from ``last``, and
writes this rank's losses and a digest of its final weights and optimizer state.

    torchrun --standalone --nproc_per_node=2 lightning_ddp_worker.py DIR EPOCHS OUT [resume]
"""

import hashlib
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from shmckpt import Tuning
from shmckpt.lightning import ShmckptCheckpointIO


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.losses = []

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.losses.append((self.global_step, loss.item().hex()))
        self.log("score", float((self.current_epoch * 7) % 5), on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


def main():
    d, epochs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    resume = len(sys.argv) > 4 and sys.argv[4] == "resume"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)
    model = Net()
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=2, strategy="ddp", deterministic=True,
        plugins=[ShmckptCheckpointIO(tuning=Tuning(chunk_size=1 << 20))],
        callbacks=[ModelCheckpoint(dirpath=d, monitor="score", mode="max", save_top_k=2, save_last=True)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=d,
    )
    trainer.fit(model, dl, ckpt_path="last" if resume else None)
    h = hashlib.sha256()
    opt = trainer.optimizers[0].state_dict()
    ts = list(model.state_dict().values())
    for st in opt["state"].values():
        ts += [st[k] for k in sorted(st)]
    for t in ts:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    with open(f"{out}.rank{trainer.global_rank}", "w") as f:
        for s, v in model.losses:
            f.write(f"{s} {v}\n")
        f.write(f"final {h.hexdigest()}\n")
    # Gloo's worker threads must stop before the interpreter does: a process group left
    # alive at exit can abort in its destructor ("terminate called without an active
    # exception", pytorch/pytorch#190489), which failed CI once.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
