"""One rank of the multi-process DCP tests (spawned by test_dcp.py / test_dcp_gpu.py).

Usage: python dcp_worker.py SCENARIO RANK WORLD WORKDIR [ARGS...]. Each rank writes
WORKDIR/result-SCENARIO-RANK.json with what it checked; the parent checks every exit
status and every result file.
"""

import faulthandler
import hashlib
import json
import os
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shmckpt import Tuning
from shmckpt.dcp import ShmckptReader, ShmckptWriter, release

warnings.filterwarnings("ignore")
CHUNK = 1 << 20


def digest(t):
    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def same(a, b):
    """Byte-exact equality of two tensors (dtype and shape too)."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and digest(a) == digest(b)


class Counter(Stateful):
    def __init__(self, n=0, device="cpu", zero=False):
        self.n = 0 if zero else n
        self.hist = torch.arange(n, dtype=torch.int64, device=device)
        if zero:
            self.hist.zero_()

    def state_dict(self):
        return {"n": self.n, "hist": self.hist}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.hist.copy_(sd["hist"])


def global_tensor(name, shape, dtype):
    g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


GLOBALS = {
    # name: (global shape, dtype); 10 rows do not divide by 4: uneven shards (3,3,3,1)
    "model.layers.0.w": ((10, 6), torch.float32),
    "model.layers.0.b": ((10,), torch.bfloat16),
    "model.emb": ((16, 3), torch.float64),
    "optim.exp_avg": ((10, 6), torch.float32),
}


def make_state(mesh, device="cpu", seed_shift=0.0):
    """A training state: DTensor Shard(0) parameters and optimizer state (FSDP2 layout),
    replicated plain tensors of several dtypes, non-tensor values and a Stateful."""
    model = {}
    for name, (shape, dtype) in GLOBALS.items():
        full = global_tensor(name, shape, dtype).to(device)
        if seed_shift:
            full = full + torch.tensor(seed_shift, dtype=full.dtype, device=device)
        model[name] = distribute_tensor(full, mesh, [Shard(0)])
    plain = {
        "step_t": torch.tensor(12345, dtype=torch.int64, device=device),
        "mask": global_tensor("mask", (7, 3), torch.bool).to(device),
        "i32": global_tensor("i32", (33,), torch.int32).to(device),
        "f16": global_tensor("f16", (4, 4), torch.float16).to(device),
        "empty": torch.empty(0, 3, device=device),
        "strided": global_tensor("strided", (6, 8), torch.float32).to(device).t(),  # a view
    }
    return {
        "model": model,
        "plain": plain,
        "step": 1000,
        "sched": {"lr": 3e-4, "betas": (0.9, 0.95), "name": "cosine", "inf": float("inf")},
        "counter": Counter(9, device),
    }


def zero_state(mesh, device="cpu"):
    st = make_state(mesh, device)
    for k, v in st["model"].items():
        st["model"][k] = distribute_tensor(torch.zeros(v.shape, dtype=v.dtype, device=device), mesh, [Shard(0)])
    st["plain"] = {k: torch.zeros_like(v) for k, v in st["plain"].items()}
    st["step"] = 0
    st["sched"] = {"lr": 0.0, "betas": (0.0, 0.0), "name": "", "inf": 0.0}
    st["counter"] = Counter(9, device, zero=True)
    return st


def compare(src, dst):
    """Every tensor byte-exact, every value equal; returns the number of checks."""
    n = 0
    for k in src["model"]:
        a, b = src["model"][k], dst["model"][k]
        assert isinstance(b, DTensor), k
        assert same(a.to_local(), b.to_local()), f"model {k} differs"
        n += 1
    for k in src["plain"]:
        assert same(src["plain"][k].contiguous(), dst["plain"][k].contiguous()), f"plain {k} differs"
        n += 1
    assert dst["step"] == src["step"], (dst["step"], src["step"])
    assert dst["sched"] == src["sched"], dst["sched"]
    assert dst["counter"].n == src["counter"].n
    assert same(dst["counter"].hist, src["counter"].hist)
    return n + 4


def init(rank, world, workdir, backend="gloo"):
    dist.init_process_group(
        backend, init_method=f"file://{workdir}/store-{os.environ.get('DCP_RUN', '0')}", rank=rank, world_size=world
    )


def result(workdir, scenario, rank, obj):
    with open(os.path.join(workdir, f"result-{scenario}-{rank}.json"), "w") as f:
        json.dump(obj, f)


def sc_roundtrip(rank, world, workdir):
    """dcp.save and dcp.async_save with ShmckptWriter, dcp.load with ShmckptReader."""
    init(rank, world, workdir)
    mesh = init_device_mesh("cpu", (world,))
    src = make_state(mesh)
    out = {}
    ck = os.path.join(workdir, "ckpt")
    dcp.save(src, storage_writer=ShmckptWriter(os.path.join(ck, "sync"), tuning=Tuning(chunk_size=CHUNK)))
    src2 = make_state(mesh, seed_shift=1.0)
    src2["step"] = 2000
    src2_ref = make_state(mesh, seed_shift=1.0)  # (collectives: not while a save uploads)
    src2_ref["step"] = 2000
    fut = dcp.async_save(src2, storage_writer=ShmckptWriter(os.path.join(ck, "async"), tuning=Tuning(chunk_size=CHUNK)))
    # Staged: changing the state now must not change the checkpoint.
    for v in src2["model"].values():
        v.to_local().zero_()
    src2["plain"]["i32"].fill_(-1)
    src2["counter"].hist.fill_(-1)
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
    dist.barrier()
    for tag, ref in (("sync", src), ("async", src2_ref)):
        dst = zero_state(mesh)
        dcp.load(dst, storage_reader=ShmckptReader(os.path.join(ck, tag)))
        out[tag] = compare(ref, dst)
    files = sorted(os.listdir(os.path.join(ck, "sync")))
    # Interchange: the rank file is plain safetensors with the local shards under DCP names.
    from safetensors import safe_open
    from safetensors.torch import load_file

    # Replicated plain tensors are written once, by one rank, by dcp.save (DCP's planner
    # de-duplicates) and by async_save alike (stage() agrees on one rank for each).
    for tag in ("sync", "async"):
        holders = {}
        for r in range(world):
            with safe_open(os.path.join(ck, tag, f"rank-{r:05d}-of-{world:05d}.safetensors"), "pt") as f:
                for k in f.keys():
                    holders.setdefault(k, []).append(r)
        for k in src["plain"]:
            assert len(holders.get(f"plain.{k}", [])) == 1, (tag, k, holders.get(f"plain.{k}"))
        out[f"{tag}_single_copies"] = len(src["plain"])

    mine = load_file(os.path.join(ck, "sync", f"rank-{rank:05d}-of-{world:05d}.safetensors"))
    for k, v in src["model"].items():
        assert same(mine[f"model.{k}"], v.to_local()), k
    out["interchange"] = len(src["model"])
    # DCP's own HuggingFaceStorageReader reads the tensors of a shmckpt checkpoint.
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    hf_dst = {f"model.{k}": torch.zeros(v.shape, dtype=v.dtype) for k, v in src["model"].items()}
    dcp.load(hf_dst, storage_reader=HuggingFaceStorageReader(os.path.join(ck, "sync")))
    for k, (shape, dtype) in GLOBALS.items():
        assert same(hf_dst[f"model.{k}"], global_tensor(k, shape, dtype)), k
    out["hf"] = len(GLOBALS)
    result(workdir, "roundtrip", rank, {"checks": out, "files": files})
    release()
    dist.destroy_process_group()


def sc_reshard_save(rank, world, workdir):
    init(rank, world, workdir)
    mesh = init_device_mesh("cpu", (world,))
    src = make_state(mesh)
    w = ShmckptWriter(os.path.join(workdir, "ckpt", "r"), tuning=Tuning(chunk_size=CHUNK))
    r = dcp.async_save(src, storage_writer=w)
    (r.upload_completion if hasattr(r, "upload_completion") else r).result()
    rows = {k: v.to_local().shape[0] for k, v in src["model"].items()}
    fsdp2 = fsdp2_save(rank, world, workdir)
    result(workdir, "reshard_save", rank, {"local_rows": rows, "fsdp2_tensors": fsdp2})
    release()
    dist.destroy_process_group()


def sc_reshard_load(rank, world, workdir):
    init(rank, world, workdir)
    mesh = init_device_mesh("cpu", (world,))
    ref = make_state(mesh)  # the same global values, sharded over this world size
    dst = zero_state(mesh)
    dcp.load(dst, storage_reader=ShmckptReader(os.path.join(workdir, "ckpt", "r")))
    n = compare(ref, dst)
    # Also load the sharded tensors whole, as plain tensors (every rank reads every shard).
    full = {"model": {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in GLOBALS.items()}}
    dcp.load(full, storage_reader=ShmckptReader(os.path.join(workdir, "ckpt", "r")))
    for k, (shape, dt) in GLOBALS.items():
        assert same(full["model"][k], global_tensor(k, shape, dt)), k
    result(workdir, "reshard_load", rank, {"checks": n, "full": len(GLOBALS), "fsdp2_checked": fsdp2_load(rank, world, workdir)})
    release()
    dist.destroy_process_group()


def shm_usage():
    """(segments, bytes) of this process's shmckpt arenas in /dev/shm."""
    n = b = 0
    for e in os.scandir("/dev/shm"):
        if e.name.startswith(f"shmckpt.{os.getpid()}."):
            n += 1
            b += e.stat().st_blocks * 512
    return n, b


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def sc_flat(rank, world, workdir, saves="100"):
    init(rank, world, workdir)
    mesh = init_device_mesh("cpu", (world,))
    src = make_state(mesh)
    src["model"]["big"] = distribute_tensor(global_tensor("big", (1024, 1024), torch.float32), mesh, [Shard(0)])
    ck = os.path.join(workdir, "ckpt")
    samples = []
    prev = None
    t0 = time.monotonic()
    for i in range(int(saves)):
        path = os.path.join(ck, f"s{i}")
        r = dcp.async_save(src, storage_writer=ShmckptWriter(path, tuning=Tuning(chunk_size=CHUNK)))
        (r.upload_completion if hasattr(r, "upload_completion") else r).result()
        dist.barrier()
        if rank == 0 and prev is not None:
            shutil.rmtree(prev)
        prev = path
        segs, shm = shm_usage()
        samples.append({"i": i, "rss": rss(), "shm": shm, "segs": segs, "fds": len(os.listdir("/proc/self/fd"))})
    dst = zero_state(mesh)
    dst["model"]["big"] = distribute_tensor(torch.zeros(1024, 1024), mesh, [Shard(0)])
    dcp.load(dst, storage_reader=ShmckptReader(prev))
    assert same(dst["model"]["big"].to_local(), src["model"]["big"].to_local())
    compare(make_state(mesh), dst)
    result(workdir, "flat", rank, {"samples": samples, "secs": time.monotonic() - t0})
    release()
    assert shm_usage() == (0, 0), shm_usage()
    dist.destroy_process_group()


def sc_gpu(rank, world, workdir):
    """NCCL (with gloo for DCP's CPU collectives) on CUDA: ordering after the current
    stream, no device memory allocated by staging, byte-exact reload into CUDA tensors."""
    torch.cuda.set_device(rank)
    init(rank, world, workdir, backend="cpu:gloo,cuda:nccl")
    mesh = init_device_mesh("cuda", (world,))
    src = make_state(mesh, device="cuda")
    ref = make_state(mesh, device="cuda")
    big = torch.ones(64 << 20, dtype=torch.float32, device="cuda")  # 256 MiB
    src["plain"]["big"] = big
    torch.cuda.synchronize()
    # Queue slow work that rewrites `big` on the current stream, then save at once: the
    # copies must come after it (the saved bytes are all 7s).
    torch.cuda._sleep(200_000_000)
    big.fill_(7.0)
    alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    r = dcp.async_save(src, storage_writer=ShmckptWriter(os.path.join(workdir, "ckpt", "g")))
    stage_alloc, stage_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    (r.upload_completion if hasattr(r, "upload_completion") else r).result()
    dst = zero_state(mesh, device="cuda")
    dst["plain"]["big"] = torch.zeros_like(big)
    # Which items can go straight to the device (whole, contiguous, non-empty CUDA
    # tensors): the reader must send exactly those through its registered buffers.
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({k: v.state_dict() if isinstance(v, Stateful) else v for k, v in dst.items()})
    local = [v.to_local() if isinstance(v, DTensor) else v for v in flat.values()]
    want_device = sum(1 for v in local if isinstance(v, torch.Tensor) and v.is_cuda and v.is_contiguous() and v.numel() > 0)
    # DCP plans no read of an empty tensor.
    want_items = sum(1 for v in local if not (isinstance(v, torch.Tensor) and v.numel() == 0))
    # Slow work queued on the current stream that writes a destination: the load's copies
    # must come after it (the loaded bytes are the saved 7s, not these 3s).
    torch.cuda._sleep(200_000_000)
    dst["plain"]["big"].fill_(3.0)
    reader = ShmckptReader(os.path.join(workdir, "ckpt", "g"))
    dcp.load(dst, storage_reader=reader)
    assert bool((dst["plain"]["big"] == 7.0).all()), "the save did not wait for the caller's stream, or the load for the destination's"
    ref["plain"]["big"] = torch.full_like(big, 7.0)
    n = compare(ref, dst)
    result(
        workdir,
        "gpu",
        rank,
        {
            "checks": n,
            "alloc": [alloc, stage_alloc],
            "reserved": [reserved, stage_reserved],
            "last_read": reader.last_read,
            "want_device": want_device,
            "items": want_items,
        },
    )
    release()
    dist.destroy_process_group()


def fsdp2_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6), torch.nn.LayerNorm(6))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def full_state(model, opt):
    """Every model and optimizer tensor gathered whole (a collective), as CPU tensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": v.full_tensor() if isinstance(v, DTensor) else v for k, v in msd.items()}
    for pid, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{pid}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    return {k: v.detach().cpu().clone() for k, v in out.items()}


def fsdp2_save(rank, world, workdir):
    """A real FSDP2 model (fully_shard on a CPU mesh) + AdamW after two steps, saved with
    async_save; returns the number of tensors of its full state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = init_device_mesh("cpu", (world,))
    model = fsdp2_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    ref = full_state(model, opt)  # (collectives: before the save uploads)
    msd, osd = get_state_dict(model, opt)
    w = ShmckptWriter(os.path.join(workdir, "ckpt", "fsdp2"), tuning=Tuning(chunk_size=CHUNK))
    r = dcp.async_save({"model": msd, "optim": osd}, storage_writer=w)
    (r.upload_completion if hasattr(r, "upload_completion") else r).result()
    if rank == 0:
        torch.save(ref, os.path.join(workdir, "fsdp2-ref.pt"))
    return len(ref)


def fsdp2_load(rank, world, workdir):
    """A fresh FSDP2 model and AdamW load the checkpoint of fsdp2_save (another world
    size) through get_state_dict / set_state_dict; every full tensor is compared."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(123)  # other initial values than the saved model
    model = fsdp2_model(mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-3, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=ShmckptReader(os.path.join(workdir, "ckpt", "fsdp2")))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full_state(model, opt)
    ref = torch.load(os.path.join(workdir, "fsdp2-ref.pt"))
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    for k in ref:
        assert same(got[k], ref[k]), k
    return len(ref)


def sc_plan_cache(rank, world, workdir, saves="3"):
    """async_save with DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)):
    from the second save on, DCP sends no plans and every rank reuses its cached final
    plan, which ShmckptWriter's prepare_global_plan made (each replicated item given to
    the rank that staged it). Every save loads byte-exact, each replicated tensor in one
    rank's file."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    import logging

    hits = []

    class Hits(logging.Handler):
        def emit(self, record):
            if "No change in the local plan" in record.getMessage():
                hits.append(record)

    log = logging.getLogger("torch.distributed.checkpoint.default_planner")
    log.addHandler(Hits())
    log.setLevel(logging.INFO)
    init(rank, world, workdir)
    mesh = init_device_mesh("cpu", (world,))
    ck = os.path.join(workdir, "ckpt")
    checked = 0
    for i in range(int(saves)):
        src = make_state(mesh, seed_shift=float(i))
        src["step"] = 1000 + i
        ref = make_state(mesh, seed_shift=float(i))
        ref["step"] = 1000 + i
        path = os.path.join(ck, f"s{i}")
        planner = DefaultSavePlanner(enable_plan_caching=True)
        r = dcp.async_save(src, storage_writer=ShmckptWriter(path, tuning=Tuning(chunk_size=CHUNK)), planner=planner)
        (r.upload_completion if hasattr(r, "upload_completion") else r).result()
        dist.barrier()
        dst = zero_state(mesh)
        dcp.load(dst, storage_reader=ShmckptReader(path))
        checked += compare(ref, dst)
        holders = {}
        for k in range(world):
            with safe_open(os.path.join(path, f"rank-{k:05d}-of-{world:05d}.safetensors"), "pt") as f:
                for name in f.keys():
                    holders.setdefault(name, []).append(k)
        for k in src["plain"]:
            assert len(holders.get(f"plain.{k}", [])) == 1, (i, k, holders.get(f"plain.{k}"))
        dist.barrier()
    result(workdir, "plan_cache", rank, {"checks": checked, "saves": int(saves), "cached_plans_used": len(hits)})
    release()
    dist.destroy_process_group()


#: Names trainers give their checkpoint directories.
DIR_NAMES = ["step-100", "checkpoint-500", "global_step1000", "epoch=3-step=900", "plain"]


def sc_dirnames(rank, world, workdir):
    """A checkpoint loads whatever its directory is called: async_save (and dcp.save for
    one name) into each of DIR_NAMES, then dcp.load of each, byte-exact."""
    init(rank, world, workdir)
    mesh = init_device_mesh("cpu", (world,))
    ck = os.path.join(workdir, "ckpt")
    checks = {}
    for i, name in enumerate(DIR_NAMES):
        src = make_state(mesh, seed_shift=float(i))
        w = ShmckptWriter(os.path.join(ck, name), tuning=Tuning(chunk_size=CHUNK))
        if name == "plain":
            dcp.save(src, storage_writer=w)
        else:
            r = dcp.async_save(src, storage_writer=w)
            (r.upload_completion if hasattr(r, "upload_completion") else r).result()
        dist.barrier()
    for i, name in enumerate(DIR_NAMES):
        ref = make_state(mesh, seed_shift=float(i))
        dst = zero_state(mesh)
        dcp.load(dst, storage_reader=ShmckptReader(os.path.join(ck, name)))
        checks[name] = compare(ref, dst)
    result(workdir, "dirnames", rank, {"checks": checks})
    release()
    dist.destroy_process_group()


def _sharded_only(mesh, shift=0.0):
    """Only Shard(0) DTensors: rank r's load reads rank r's file only."""
    return {
        "model": {
            k: distribute_tensor(global_tensor(k, shape, dt) + torch.tensor(shift, dtype=dt), mesh, [Shard(0)])
            for k, (shape, dt) in GLOBALS.items()
        }
    }


def _load_outcome(path, mesh, dst=None):
    """dcp.load of ``path``: ("ok", seconds) or (the failure's description, seconds)."""
    t = time.monotonic()
    dst = dst if dst is not None else _sharded_only(mesh, 0.0)
    try:
        dcp.load(dst, storage_reader=ShmckptReader(path))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        failures = getattr(e, "failures", None) or {}
        inner = {int(r): type(f[0] if isinstance(f, tuple) else f).__name__ for r, f in failures.items()}
        return {"raised": type(e).__name__, "failures": inner, "secs": time.monotonic() - t}
    return {"raised": None, "secs": time.monotonic() - t}


def sc_failed_load(rank, world, workdir):
    """A load that fails on one rank raises on every rank, promptly, and leaves the group
    usable: (1) rank 1's file is corrupted (only rank 1 reads it); (2) rank 0's first
    read of .metadata fails once (a transient failure: DCP's fallback to "rank local
    metadata" must not split the ranks into different collectives). After each, every
    rank loads a good checkpoint through the same group."""
    init(rank, world, workdir)
    mesh = init_device_mesh("cpu", (world,))
    ck = os.path.join(workdir, "ckpt")
    good, bad = os.path.join(ck, "step-1"), os.path.join(ck, "step-2")
    for path, shift in ((good, 1.0), (bad, 2.0)):
        dcp.save(_sharded_only(mesh, shift), storage_writer=ShmckptWriter(path, tuning=Tuning(chunk_size=CHUNK)))
    dist.barrier()
    if rank == 0:
        f = os.path.join(bad, f"rank-00001-of-{world:05d}.safetensors")
        data = bytearray(open(f, "rb").read())
        data[-3] ^= 0x10  # in the last tensor's bytes
        with open(f, "wb") as fh:
            fh.write(data)
    dist.barrier()
    out = {"corrupt": _load_outcome(bad, mesh)}
    dist.barrier()
    import shmckpt.dcp.reader as sd  # where ShmckptReader looks _load_metadata up

    real = sd._load_metadata
    calls = []

    def flaky(path):
        calls.append(path)
        if rank == 0 and len(calls) == 1:
            raise FileNotFoundError(f"{path}: (injected) not visible yet")
        return real(path)

    sd._load_metadata = flaky
    try:
        out["flaky_metadata"] = _load_outcome(good, mesh)
    finally:
        sd._load_metadata = real
    out["metadata_reads"] = len(calls)
    dist.barrier()
    dst = _sharded_only(mesh, 0.0)
    out["after"] = _load_outcome(good, mesh, dst)
    ref = _sharded_only(mesh, 1.0)
    out["after_checked"] = sum(same(ref["model"][k].to_local(), dst["model"][k].to_local()) for k in GLOBALS)
    result(workdir, "failed_load", rank, out)
    release()
    dist.destroy_process_group()


SCENARIOS = {
    "roundtrip": sc_roundtrip,
    "reshard_save": sc_reshard_save,
    "reshard_load": sc_reshard_load,
    "flat": sc_flat,
    "plan_cache": sc_plan_cache,
    "gpu": sc_gpu,
    "dirnames": sc_dirnames,
    "failed_load": sc_failed_load,
}

if __name__ == "__main__":
    # A hang prints every thread's stack and fails instead of waiting for the test's timeout.
    faulthandler.dump_traceback_later(float(os.environ.get("DCP_WORKER_TIMEOUT", "150")), exit=True)
    scenario, rank, world, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    SCENARIOS[scenario](rank, world, workdir, *sys.argv[5:])
