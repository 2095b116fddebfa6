"""Child process of the multi-rank S3 test in test_remote.py (not a test module).

    python remote_worker.py ROOT URL RANK WORLD PORT OUT   # save to the bucket over gloo
                                                          # (ROOT "-": remote only)
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import shmckpt
from dist_worker import digest, rank_state


def main(root, url, rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if root == "-":
        ck = shmckpt.Checkpointer(url, tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20))
    else:
        ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20), remote=url)
    res = {"committed_here": [], "ok": []}
    for step in (5, 6):
        h = ck.save(step, rank_state(rank, world, step))
        h.wait()
        rep = h.wait_remote()
        res["committed_here"].append(rep["committed_here"])
    res["remote"] = ck.list(remote=True)
    dist.barrier()
    for step in (5, 6):
        want = rank_state(rank, world, step)
        got = ck.load(step, source="remote")
        res["ok"].append(
            got["who"] == want["who"]
            and digest(got["model"]["w"]) == digest(want["model"]["w"])
            and digest(got["model"]["b"]) == digest(want["model"]["b"])
        )
    res["source"] = ck.last_load_source[0]
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), a[5])
