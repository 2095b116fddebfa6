"""DCP async_save through ShmckptWriter interleaved with native Checkpointer saves of the
same GPU state (4 GiB in 600 fp32 tensors), printing each call's time and whether the
writer's engine is reused: a diagnostic of the training benchmark's slow first DCP save
per segment (benches/JOURNAL.md). One GPU:

    python3 benches/dcp/interleave.py
"""
import os, sys, time, socket, shutil
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
import shmckpt, shmckpt.dcp as sd, shmckpt.dcp.engines as sd_engines
from shmckpt.dcp import ShmckptWriter
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.cuda.set_device(0)
D = "/var/tmp/diag"; shutil.rmtree(D, ignore_errors=True); os.makedirs(D)
n, per = 600, (4 << 30) // 600 // 4
state = {f"t{i}": torch.randn(per, device="cuda") for i in range(n)}
nbytes = sum(t.numel() * 4 for t in state.values())
session = sd_engines.SESSION
orig = session.engine
def wrapped(*a, **k):
    t = time.perf_counter(); r = orig(*a, **k); print(f"    engine {time.perf_counter()-t:.3f}s need={a[3]} cap={r.capacity} gen={session.generations()}", flush=True); return r
session.engine = wrapped
os.makedirs(os.path.join(D, "ck")); ck = shmckpt.Checkpointer(os.path.join(D, "ck"), keep_last=1, tuning=shmckpt.Tuning(staging_capacity=nbytes + (256 << 20))); ck.prepare_cuda()
step = 0
def native():
    global step; step += 1
    torch.cuda.synchronize(); t = time.perf_counter(); h = ck.save(step, state); r = time.perf_counter() - t; h.wait(); print(f"native save {r:.3f}s", flush=True)
def dshm():
    global step; step += 1
    torch.cuda.synchronize(); t = time.perf_counter()
    resp = dcp.async_save(state, storage_writer=ShmckptWriter(os.path.join(D, "d", f"step-{step:08d}"), tuning=shmckpt.Tuning(staging_capacity=nbytes + (256 << 20))))
    r = time.perf_counter() - t
    (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
    print(f"dcp-shm save {r:.3f}s  total {time.perf_counter()-t:.3f}s", flush=True)
for f in (dshm, dshm, native, native, dshm, dshm, native, dshm):
    f()
ck.close(); sd.release(); dist.destroy_process_group()
