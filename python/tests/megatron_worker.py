"""One rank of the Megatron-Core tests (spawned by test_megatron.py).

Usage: python megatron_worker.py SCENARIO RANK WORLD WORKDIR. Each rank writes
WORKDIR/result-SCENARIO-RANK.json with what it checked; the parent checks every exit
status and every result file.

On CPU (gloo), Megatron's ``AsyncCallsQueue`` runs unchanged except for two calls it
hard-codes to CUDA, which have no CPU form: ``TemporalAsyncCaller`` calls
``torch.cuda.synchronize()`` before forking its worker, and its done/finalize flags are
tensors on ``torch.cuda.current_device()``. ``_cpu_stand_ins`` points those two at the
CPU (a no-op and the CPU device) in this process only; everything of shmckpt's and of
Megatron's planning, AsyncRequest, fork, finalize and load runs as on a GPU machine.
"""

import faulthandler
import hashlib
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue as McoreQueue  # noqa: E402

import shmckpt.megatron as smg  # noqa: E402
from shmckpt import Tuning  # noqa: E402


def async_queue(persistent=False):
    """The queue a Megatron user schedules with, and the ``async_strategy`` to save with
    (None: megatron-core 0.16, whose ``save`` has no such argument). On 0.19 with
    nvidia-resiliency-ext installed: NVRx's ``AsyncCallsQueue`` ("nvrx", 0.19's default);
    without it, Megatron's ("mcore")."""
    if not smg._NEW_LAYOUT:
        return McoreQueue(persistent=persistent), None
    try:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue as NvrxQueue
    except ImportError:
        return McoreQueue(persistent=persistent), "mcore"
    return NvrxQueue(persistent=persistent), "nvrx"


def save(sd, d, strategy, async_strategy, **kw):
    """``dist_checkpointing.save``, with ``async_strategy`` where megatron-core takes it."""
    if async_strategy is not None:
        kw["async_strategy"] = async_strategy
    return dist_checkpointing.save(sd, d, strategy, **kw)


def load(sd, d):
    """``dist_checkpointing.load``: on 0.16 with the strategy Megatron finds from
    metadata.json (shmckpt's, registered at import), on 0.19 (no registry) with
    ``ShmckptLoadShardedStrategy`` passed."""
    if smg._NEW_LAYOUT:
        return dist_checkpointing.load(sd, d, sharded_strategy=smg.ShmckptLoadShardedStrategy())
    return dist_checkpointing.load(sd, d)


def expected_request():
    """[async_strategy, the AsyncRequest's package] that ``async_queue`` leads to here."""
    if not smg._NEW_LAYOUT:
        return [None, "megatron"]
    try:
        import nvidia_resiliency_ext.checkpointing.async_ckpt.core  # noqa: F401
    except ImportError:
        return ["mcore", "megatron"]
    return ["nvrx", "nvidia_resiliency_ext"]


def request_module(req):
    """Which package's AsyncRequest class ``req`` is (megatron or nvidia_resiliency_ext)."""
    return type(req).__module__.split(".")[0]


def _cpu_stand_ins():
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def global_tensor(name, shape, dtype):
    g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def digest(t):
    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


#: name -> (global shape, dtype, sharded axis or None for replicated)
LAYOUT = {
    "decoder.layers.qkv.weight": ((8, 6), torch.float32, 0),
    "decoder.layers.proj.weight": ((4, 12), torch.bfloat16, 1),
    "decoder.final_norm.bias": ((6,), torch.float32, None),
}


def sharded_state(rank, world, zero=False, objects=True):
    """A Megatron sharded state dict: tensor-parallel shards (dim 0 and dim 1), a
    replicated tensor (main replica on rank 0), one ShardedObject per rank, and common
    (non-sharded) values. ``zero``: the same layout with zeroed tensors (a load target)."""
    sd = {"model": {}, "common": {"iteration": 7, "args": {"lr": 0.5, "name": "tiny"}}}
    for name, (shape, dtype, axis) in LAYOUT.items():
        g = global_tensor(name, shape, dtype)
        if axis is None:
            local = g.clone()
            st = ShardedTensor.from_rank_offsets(name, local, replica_id=rank)
        else:
            local = g.chunk(world, dim=axis)[rank].clone()
            st = ShardedTensor.from_rank_offsets(name, local, (axis, rank, world))
        if zero:
            local.zero_()
        sd["model"][name] = st
    if objects:
        sd["rng"] = ShardedObject(
            "rng_state", {"rank": rank, "seed": 1234 + rank} if not zero else None, (world,), (rank,), replica_id=0
        )
    return sd


def expected_local(name, rank, world):
    shape, dtype, axis = LAYOUT[name]
    g = global_tensor(name, shape, dtype)
    return g if axis is None else g.chunk(world, dim=axis)[rank]


def init(rank, world, workdir, tag):
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(workdir, 'store-' + tag)}", rank=rank, world_size=world
    )


def check_loaded(loaded, rank, world):
    """Byte-exact comparison of a loaded state with what was saved. Returns the checks."""
    out = {}
    for name in LAYOUT:
        t = loaded["model"][name]
        e = expected_local(name, rank, world)
        out[name] = [str(t.dtype), list(t.shape), digest(t) == digest(e) and t.dtype == e.dtype]
    out["common"] = loaded["common"]
    if "rng" in loaded:
        out["rng"] = loaded["rng"]
    return out


def scenario_async_queue(rank, world, workdir):
    """Save twice through Megatron's AsyncCallsQueue (TemporalAsyncCaller: fork), the
    second while the first is still pending, mutating the tensors right after each
    async_save returned; finalize; load back through dist_checkpointing.load."""
    _cpu_stand_ins()
    init(rank, world, workdir, "async")
    res = {}
    q, how = async_queue()
    strategy = smg.ShmckptSaveShardedStrategy(tuning=Tuning(chunk_size=1 << 20))
    dirs = [os.path.join(workdir, "ckpt", f"iter_{i:07d}") for i in (1, 2)]
    for i, d in enumerate(dirs):
        if rank == 0:
            os.makedirs(d)
        dist.barrier()
        sd = sharded_state(rank, world)
        req = save(sd, d, strategy, how, async_sharded_save=True)
        res["request"] = [how, request_module(req)]
        # Staged: the trainer may change its tensors now.
        for st in sd["model"].values():
            st.data.add_(1000 + i)
        res[f"files_before_finalize_{i}"] = sorted(os.listdir(d))
        q.schedule_async_request(req)
    done = []
    deadline = time.time() + 120
    while q.get_num_unfinalized_calls() and time.time() < deadline:
        done += q.maybe_finalize_async_calls(blocking=False)
        time.sleep(0.05)
    res["finalized"] = done
    q.close()
    dist.barrier()
    res["files"] = sorted(os.listdir(dirs[1]))
    with open(os.path.join(dirs[1], "metadata.json")) as f:
        res["metadata_json"] = json.load(f)
    for i, d in enumerate(dirs):
        target = sharded_state(rank, world, zero=True)
        loaded = load(target, d)
        res[f"loaded_{i}"] = check_loaded(loaded, rank, world)
    # The load strategy Megatron picks from metadata.json (0.16's registry; 0.19 has none):
    res["load_strategy"] = type(dist_checkpointing.serialization.get_default_load_sharded_strategy(dirs[0])).__name__
    dist.barrier()
    return res


def scenario_sync(rank, world, workdir):
    """Megatron's synchronous path (async_sharded_save=False: the strategy's save runs
    the AsyncRequest in place) and a load."""
    init(rank, world, workdir, "sync")
    d = os.path.join(workdir, "ckpt", "iter_0000003")
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    strategy = smg.ShmckptSaveShardedStrategy(tuning=Tuning(chunk_size=1 << 20))
    ret = dist_checkpointing.save(sharded_state(rank, world), d, strategy)
    res = {"returned": repr(ret), "files": sorted(os.listdir(d))}
    loaded = load(sharded_state(rank, world, zero=True), d)
    res["loaded"] = check_loaded(loaded, rank, world)
    dist.barrier()
    return res


def scenario_reshard_load(rank, world, workdir):
    """Load the checkpoint the 2-rank async scenario saved with this world size."""
    init(rank, world, workdir, f"reshard{world}")
    d = os.path.join(workdir, "ckpt", "iter_0000002")
    # A ShardedObject's key names the world it was saved with: tensors only here.
    loaded = load(sharded_state(rank, world, zero=True, objects=False), d)
    res = {"loaded": check_loaded(loaded, rank, world)}
    dist.barrier()
    return res


def scenario_fail(rank, world, workdir):
    """Rank 1's write fails (its write results raise what the engine would): finalize
    raises CheckpointException on every rank, naming rank 1, and nothing is committed."""
    _cpu_stand_ins()
    init(rank, world, workdir, "fail")
    d = os.path.join(workdir, "ckpt", "iter_0000009")
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    if rank == 1:

        def failed(self):
            self._watcher.join()
            raise smg.SaveFailed("injected: rank 1's file could not be written")

        smg._MegatronWriter.retrieve_write_results = failed
    q, how = async_queue()
    strategy = smg.ShmckptSaveShardedStrategy(tuning=Tuning(chunk_size=1 << 20))
    req = save(sharded_state(rank, world), d, strategy, how, async_sharded_save=True)
    q.schedule_async_request(req)
    res = {}
    try:
        q.maybe_finalize_async_calls(blocking=True)
        res["error"] = None
    except BaseException as e:  # CheckpointException is a BaseException
        res["error"] = type(e).__name__
        res["failed_ranks"] = sorted(getattr(e, "failures", {}))
        res["message"] = str(e)[:500]
    dist.barrier()
    res["files"] = sorted(os.listdir(d))
    return res


def tiny_gpt(seed, device):
    """A tiny megatron-core GPT with the local layer spec (no TransformerEngine), its
    weights drawn from ``seed``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True, perform_initialization=True
    )
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32)
    return model.to(device)


def model_digests(model):
    return {k: [str(v.dtype), list(v.shape), digest(v)] for k, v in model.state_dict().items() if v is not None}


def scenario_gpt_cpu(rank, world, workdir):
    """A tiny GPT (local spec) on CPU, data parallel over ``world`` gloo ranks: its
    sharded state dict saved through Megatron's queue, the weights changed right after
    async_save returned (as a training step would), finalized, then loaded into a fresh
    GPT of another seed: bit-exact to the weights at the save."""
    from megatron.core import parallel_state

    _cpu_stand_ins()
    init(rank, world, workdir, "gpt")
    parallel_state.initialize_model_parallel(1, 1)
    model = tiny_gpt(1, "cpu")
    want = model_digests(model)
    d = os.path.join(workdir, "ckpt", "iter_0000005")
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    q, how = async_queue()
    strategy = smg.ShmckptSaveShardedStrategy(tuning=Tuning(chunk_size=1 << 20))
    req = save({"model": model.sharded_state_dict(), "iteration": 5}, d, strategy, how, async_sharded_save=True)
    q.schedule_async_request(req)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    q.maybe_finalize_async_calls(blocking=True)
    fresh = tiny_gpt(2, "cpu")
    res = {"differs_before_load": model_digests(fresh) != want}
    loaded = load({"model": fresh.sharded_state_dict(), "iteration": None}, d)
    fresh.load_state_dict(loaded["model"])
    got = model_digests(fresh)
    res["tensors"] = len(want)
    res["bit_exact"] = got == want
    res["iteration"] = loaded["iteration"]
    res["written_bytes"] = smg_bytes(strategy)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    return res


def scenario_gpu_train(rank, world, workdir):
    """A tiny GPT (local spec) trained on the GPU (NCCL, one rank per GPU) with Adam;
    async saves through Megatron's AsyncCallsQueue at steps 1 and 3, training on while
    they write (the queue polled each step, as Megatron-LM's loop does); device memory
    is measured right before and after each save call, and after moving the
    model to the CPU while the save is still unfinalized (nothing of shmckpt's holds its
    device memory); then finalize, and load into a fresh GPT of another seed: bit-exact
    to the weights at the save, through the device path of shmckpt's reader."""
    from megatron.core import parallel_state

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{os.path.join(workdir, 'store-gpu')}", rank=rank, world_size=world
    )
    parallel_state.initialize_model_parallel(1, 1)
    model = tiny_gpt(1, "cuda")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(7 + rank)
    seq = 32
    pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(4, -1)
    mask = torch.triu(torch.ones(1, 1, seq, seq, device="cuda", dtype=torch.bool), diagonal=1)

    def step():
        ids = torch.randint(0, 128, (4, seq), device="cuda", generator=g)
        loss = model(ids, pos, mask, labels=ids).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss)

    dirs = {it: os.path.join(workdir, "ckpt", f"iter_{it:07d}") for it in (1, 3)}
    if rank == 0:
        for d in dirs.values():
            os.makedirs(d)
    dist.barrier()
    d = dirs[3]
    # On 0.19 with NVRx: NVRx's persistent worker (its default), the request pickled to it.
    q, how = async_queue(persistent=smg._NEW_LAYOUT)
    strategy = smg.ShmckptSaveShardedStrategy()
    res = {"losses": [], "queue": [type(q).__module__.split(".")[0], how, smg.MEGATRON_VERSION]}
    want = None
    for it in range(8):
        res["losses"].append(step())
        if it in dirs:
            # Step 1's save is the first one: it opens the engine (arena) and warms the
            # caching allocator for Megatron's own planning collectives (object
            # collectives on NCCL stage their bytes on the device). Step 3's is measured.
            want = model_digests(model)
            torch.cuda.synchronize()
            reserved0, allocated0 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            req = save(
                {"model": model.sharded_state_dict(), "iteration": it}, dirs[it], strategy, how, async_sharded_save=True
            )
            q.schedule_async_request(req)
            res[f"save_call_s_{it}"] = time.perf_counter() - t0
            torch.cuda.synchronize()
            res[f"reserved_before_after_save_{it}"] = [reserved0, torch.cuda.memory_reserved()]
            res[f"allocated_before_after_save_{it}"] = [allocated0, torch.cuda.memory_allocated()]
        q.maybe_finalize_async_calls(blocking=False)
    res["unfinalized_at_end_of_training"] = q.get_num_unfinalized_calls()
    # Offload while the save may still be unfinalized: the model's device memory is
    # freed (nothing of the save references it), as NeMo-RL needs before offloading.
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt.state.clear()
    opt.zero_grad(set_to_none=True)
    before = torch.cuda.memory_allocated()
    model.cpu()
    res["freed_by_offload_vs_param_bytes"] = [before - torch.cuda.memory_allocated(), param_bytes]
    q.maybe_finalize_async_calls(blocking=True)
    q.close()
    fresh = tiny_gpt(2, "cuda")
    res["differs_before_load"] = model_digests(fresh) != want
    reader_stats = {}
    orig = smg.ShmckptLoadShardedStrategy._reader

    def spy(self, checkpoint_dir):
        r = orig(self, checkpoint_dir)
        reader_stats["reader"] = r
        return r

    smg.ShmckptLoadShardedStrategy._reader = spy
    loaded = load({"model": fresh.sharded_state_dict(), "iteration": None}, d)
    fresh.load_state_dict(loaded["model"])
    res["bit_exact"] = model_digests(fresh) == want
    res["tensors"] = len(want)
    res["iteration"] = loaded["iteration"]
    res["last_read"] = reader_stats["reader"].last_read
    dist.barrier()
    parallel_state.destroy_model_parallel()
    return res


def smg_bytes(strategy):
    rep = strategy.last_writer.last_report if strategy.last_writer is not None else None
    return int(rep.get("bytes", -1)) if rep else -1


def main():
    faulthandler.dump_traceback_later(200, exit=True)  # a hung rank fails, with its stacks
    scenario, rank, world, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    res = globals()[f"scenario_{scenario}"](rank, world, workdir)
    with open(os.path.join(workdir, f"result-{scenario}-{world}-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
