"""One rank of the multi-process export tests (spawned by test_export.py).

Usage: python export_worker.py SCENARIO RANK WORLD WORKDIR. A tiny Llama model (CPU) is
trained a few steps over gloo, saved, and (rank 0) exported with shmckpt.export and loaded
back with transformers' from_pretrained; rank 0 writes WORKDIR/result-SCENARIO.json with
what it compared.

* ``ddp``: DistributedDataParallel, saved through shmckpt.Checkpointer (every rank saves
  its replica; the export reads one).
* ``fsdp2``: torch.distributed.fsdp.fully_shard (row shards), saved through DCP with
  ShmckptWriter; then the same full weights saved as column shards (Shard(1), tensor
  parallel's layout) and exported again.
"""

import faulthandler
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).float()


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 96, (2, 12), generator=g)


def train(model, rank, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(steps):
        ids = batch(rank, s)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


PROBE = torch.arange(20).reshape(2, 10) % 96


def check_export(src, out, reference, extra=None):
    """Export src to out, load it with from_pretrained, compare logits with `reference`'s."""
    import shmckpt
    from transformers import AutoModelForCausalLM

    rep = shmckpt.export(src, out, max_shard_size="20KB", **(extra or {}))
    reference.config.save_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        want = reference(input_ids=PROBE).logits
        got = loaded(input_ids=PROBE).logits
    ref_sd = reference.state_dict()
    got_sd = loaded.state_dict()
    return {
        "files": rep.files,
        "tensors": rep.tensors,
        "equal_logits": bool(torch.equal(want, got)),
        "equal_weights": sorted(ref_sd) == sorted(got_sd) and all(torch.equal(ref_sd[k], got_sd[k]) for k in ref_sd),
        "names": sorted(json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]),
        "state_names": sorted(ref_sd),
    }


def sc_ddp(rank, world, workdir):
    import shmckpt
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tiny_model()
    ddp = DDP(model)
    opt = train(ddp, rank)
    root = os.path.join(workdir, "ckpt")
    ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=16 << 20, chunk_size=1 << 20))
    ck.save(3, {"model": ddp.module.state_dict(), "optim": opt.state_dict(), "step": 3}).wait()
    dist.barrier()
    if rank == 0:
        res = check_export(root, os.path.join(workdir, "hf"), model)
        json.dump(res, open(os.path.join(workdir, "result-ddp.json"), "w"))
    dist.barrier()
    ck.close()


def sc_fsdp2(rank, world, workdir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from shmckpt.dcp import ShmckptWriter

    mesh = init_device_mesh("cpu", (world,))
    model = tiny_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = train(model, rank)
    path = os.path.join(workdir, "dcp-fsdp")
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, storage_writer=ShmckptWriter(path))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    # The same weights as column shards (tensor parallel's layout) where a second dim is.
    cols = {
        k: distribute_tensor(v.clone(), mesh, [Shard(1)]) if v.dim() == 2 else distribute_tensor(v.clone(), mesh, [Shard(0)])
        for k, v in full.items()
    }
    path_tp = os.path.join(workdir, "dcp-tp")
    dcp.save({"model": cols}, storage_writer=ShmckptWriter(path_tp))
    dist.barrier()
    if rank == 0:
        ref = tiny_model()
        ref.load_state_dict(full)
        res = {
            "fsdp": check_export(path, os.path.join(workdir, "hf-fsdp"), ref),
            "tp": check_export(path_tp, os.path.join(workdir, "hf-tp"), ref),
            "sharded_rank_files": all(
                v.to_local().shape != v.shape for v in model.state_dict().values() if v.dim() and v.shape[0] >= world
            ),
        }
        json.dump(res, open(os.path.join(workdir, "result-fsdp2.json"), "w"))
    dist.barrier()


SCENARIOS = {"ddp": sc_ddp, "fsdp2": sc_fsdp2}

if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("EXPORT_WORKER_TIMEOUT", "150")), exit=True)
    scenario, rank, world, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store-{scenario}", rank=rank, world_size=world)
    try:
        SCENARIOS[scenario](rank, world, workdir)
    finally:
        dist.destroy_process_group()
