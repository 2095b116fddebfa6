"""One rank of the DCP-in-a-bucket tests (spawned by test_dcp_remote.py; not a test module).

    python dcp_remote_worker.py MODE URL RANK WORLD PORT OUT

MODE ``save``: ``dcp.save`` (step URL) and ``dcp.async_save`` (URL's step + 1) of this
rank's state to the bucket with ``ShmckptWriter``; ``load``: ``dcp.load`` of both with
``ShmckptReader`` into zeroed tensors. Writes to OUT, as JSON, what it checked: every
loaded tensor's digest against the one saved (computed here from the seed), the plain
values, and the objects in the bucket it read from."""

import hashlib
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shmckpt.dcp import ShmckptReader, ShmckptWriter, release

warnings.filterwarnings("ignore")


def digest(t):
    t = t.detach().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def state(rank, step, zero=False):
    g = torch.Generator().manual_seed(1000 * step + rank)
    sd = {
        # A replicated tensor (same on every rank), per-rank tensors, a value.
        "shared": torch.arange(4096, dtype=torch.float32) * step,
        f"w{rank}": torch.randn(3, 1 << 16, generator=g),
        f"b{rank}": torch.randint(-100, 100, (333,), generator=g, dtype=torch.int64),
        f"bf{rank}": torch.randn(257 + rank, generator=g).to(torch.bfloat16),
        "meta": {"step": step, "lr": 0.5 * step},
    }
    if zero:
        for k, v in list(sd.items()):
            if isinstance(v, torch.Tensor):
                sd[k] = torch.zeros_like(v)
        sd["meta"] = {"step": -1, "lr": -1.0}
    return sd


def main(mode, url, rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    root, _, last = url.rpartition("/")
    step = int(last.split("-")[1])
    urls = {step: url, step + 1: f"{root}/step-{step + 1}"}
    res = {}
    if mode == "save":
        dcp.save(state(rank, step), storage_writer=ShmckptWriter(urls[step]))
        w = ShmckptWriter(urls[step + 1])
        fut = dcp.async_save(state(rank, step + 1), storage_writer=w)
        fut.result()
        res["remote_committed"] = w.last_report["remote"]["step"]
    else:
        for s, u in urls.items():
            got = state(rank, s, zero=True)
            r = ShmckptReader(u)
            dcp.load(got, storage_reader=r)
            want = state(rank, s)
            res[str(s)] = {
                "tensors": {
                    k: (digest(got[k]) == digest(want[k]) and got[k].dtype == want[k].dtype)
                    for k in want
                    if isinstance(want[k], torch.Tensor)
                },
                "meta": got["meta"] == want["meta"],
                "files": r.last_read["files"],
            }
    release()
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), a[5])
