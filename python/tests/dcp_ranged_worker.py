"""One rank of test_dcp_ranged.py: a DCP save on 2 gloo ranks whose sharded tensors live in
each rank's own file and whose replicated tensors DCP spreads over both files, then loads
that read only the tensors each rank's plan names.

Usage: python dcp_ranged_worker.py RANK WORLD WORKDIR. Writes WORKDIR/result-ranged-RANK.json.
"""

import faulthandler
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_worker import global_tensor, init, result, same
from shmckpt import Tuning
from shmckpt.dcp import ShmckptReader, ShmckptWriter, release

warnings.filterwarnings("ignore")

#: Sharded on dim 0 over the ranks (world 2): 256 KiB and 512 KiB per rank.
SHARDED = {"shard.a": ((128, 1024), torch.float32), "shard.b": ((64, 4096), torch.float32)}
#: Replicated (every rank holds and loads all of them): DCP saves each once, spread over the
#: rank files (2 MB in all, more than a rank's shards, so that DCP's balancing gives both
#: files some).
REPLICATED = {
    "rep.0": ((100, 1000), torch.float32),
    "rep.1": ((200_000,), torch.bfloat16),
    "rep.2": ((30_000,), torch.int64),
    "rep.3": ((70, 3000), torch.float32),
    "rep.4": ((5,), torch.float64),
    "rep.5": ((256, 256), torch.float16),
}


def state(mesh, zero=False):
    def val(name, shape, dtype):
        t = global_tensor(name, shape, dtype)
        return torch.zeros_like(t) if zero else t

    return {
        "sharded": {k: distribute_tensor(val(k, s, d), mesh, [Shard(0)]) for k, (s, d) in SHARDED.items()},
        "rep": {k: val(k, s, d) for k, (s, d) in REPLICATED.items()},
        "step": 0 if zero else 4321,
    }


def check(src, dst):
    n = 0
    for k in SHARDED:
        assert same(src["sharded"][k].to_local(), dst["sharded"][k].to_local()), k
        n += 1
    for k in REPLICATED:
        assert same(src["rep"][k], dst["rep"][k]), k
        n += 1
    assert dst["step"] == src["step"]
    return n + 1


def main(rank, world, workdir):
    init(rank, world, workdir)
    mesh = init_device_mesh("cpu", (world,))
    path = os.path.join(workdir, "ckpt", "c")
    src = state(mesh)
    dcp.save(src, storage_writer=ShmckptWriter(path, tuning=Tuning(chunk_size=1 << 20)))
    out = {}
    for label, direct_io in (("buffered", False), ("direct", True)):
        dst = state(mesh, zero=True)
        reader = ShmckptReader(path, direct_io=direct_io)
        dcp.load(dst, storage_reader=reader)
        out[label] = {"checks": check(src, dst), "io": reader.last_read_io, "files": reader.last_read["files"]}
    result(workdir, "ranged", rank, out)
    release()
    dist.destroy_process_group()


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("DCP_WORKER_TIMEOUT", "150")), exit=True)
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
