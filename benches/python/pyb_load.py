"""py_bench.py section 3: loads against safetensors, torch.load, DCP, raw reads, H2D."""

from __future__ import annotations

import gc
import os
import time
import traceback
from typing import Any, Callable, Dict, List

import torch

from pyb_common import gbps, locate_file, med, ratio, raw_read, sync
from pyb_results import Ctx


# ----------------------------------------------------------------------------- 3. load
def section_load(ctx: Ctx, sname: str, st: Dict[str, Any], rec: Dict[str, Any]) -> None:
    a, dev, bud = ctx.args, ctx.device, ctx.budget
    state, ckpt, pinned, nbytes = st["state"], st["ckpt"], st["pinned"], st["nbytes"]
    read_est = nbytes / (a.read_gbps * 1e9) + 0.5
    cuda = dev.startswith("cuda")
    map_loc = "cuda:0" if cuda else "cpu"
    if st.get("last_step") is None or st.get("dirty"):
        step = st["next_step"]
        st["next_step"] += 1
        st["last_file"] = ckpt.save(step, state).wait().get("file")
        st["last_step"] = step
        st["dirty"] = False
        rec["fresh_save_before_load"] = True
    step = st["last_step"]
    path = st.get("last_file")
    if not path or not os.path.isfile(path):
        path = locate_file(ckpt, step)
    rec.update(file=path, file_bytes=os.path.getsize(path), runs={})

    import safetensors.torch as sft

    methods: Dict[str, Callable[[], Any]] = {}
    methods["shmckpt_load"] = lambda: ckpt.load(step, map_location=map_loc)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    methods["shmckpt_load_into"] = lambda: ckpt.load_into(target, step)
    methods["safetensors_load_file"] = lambda: sft.load_file(path, device=map_loc)
    if a.safetensors_fast:
        def st_fast() -> Any:
            old = os.environ.get("SAFETENSORS_FAST_CUDA")
            os.environ["SAFETENSORS_FAST_CUDA"] = "1"
            try:
                return sft.load_file(path, device=map_loc)
            finally:
                if old is None:
                    os.environ.pop("SAFETENSORS_FAST_CUDA", None)
                else:
                    os.environ["SAFETENSORS_FAST_CUDA"] = old
        methods["safetensors_fast_cuda_env"] = st_fast
    tpath = os.path.join(a.root, f"torch-{sname}.pt")
    if a.torch_load and bud.allows(3 * read_est + 2 * nbytes / (a.disk_gbps * 1e9)):
        t = time.perf_counter()
        with open(tpath, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        rec["torch_save_fsync_s"] = time.perf_counter() - t
        methods["torch_load"] = lambda: torch.load(tpath, map_location=map_loc, weights_only=True)
    else:
        rec.setdefault("skipped", []).append("torch.load: budget or --no-torch-load")
    files_of: Dict[str, List[str]] = {"torch_load": [tpath]}
    dcp_dirs: List[str] = []
    if a.dcp_load and bud.allows(4 * read_est + 3 * nbytes / (a.disk_gbps * 1e9)):
        # The same state as a DCP checkpoint: DCP's own FileSystemWriter (torch.save
        # streams, fsynced) read back by FileSystemReader, and shmckpt's ShmckptWriter read
        # back by ShmckptReader; both loaded into existing tensors on the device.
        import shutil

        import torch.distributed.checkpoint as dcp
        from shmckpt.dcp import ShmckptReader, ShmckptWriter

        fs_dir = os.path.join(a.root, f"dcp-fs-{sname}")
        sh_dir = os.path.join(a.root, f"dcp-shm-{sname}")
        for d in (fs_dir, sh_dir):
            shutil.rmtree(d, ignore_errors=True)
        t = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(fs_dir, sync_files=True))
        rec["dcp_filesystemwriter_save_s"] = time.perf_counter() - t
        t = time.perf_counter()
        dcp.save(state, storage_writer=ShmckptWriter(sh_dir))
        rec["dcp_shmckptwriter_save_s"] = time.perf_counter() - t
        dcp_dirs += [fs_dir, sh_dir]
        fs_target = {k: torch.empty_like(v) for k, v in state.items()}
        sh_target = {k: torch.empty_like(v) for k, v in state.items()}
        readers: Dict[str, Any] = {}

        def dcp_fs() -> Any:
            dcp.load(fs_target, storage_reader=dcp.FileSystemReader(fs_dir))
            return fs_target

        def dcp_shm() -> Any:
            r = ShmckptReader(sh_dir)
            dcp.load(sh_target, storage_reader=r)
            readers["last"] = r.last_read
            return sh_target

        methods["dcp_load_filesystemreader"] = dcp_fs
        methods["dcp_load_shmckptreader"] = dcp_shm
        files_of["dcp_load_filesystemreader"] = [os.path.join(fs_dir, f) for f in sorted(os.listdir(fs_dir))]
        files_of["dcp_load_shmckptreader"] = [os.path.join(sh_dir, f) for f in sorted(os.listdir(sh_dir))]
        rec["shmckptreader_last_read"] = readers
    else:
        rec.setdefault("skipped", []).append("dcp loads: budget or --no-dcp-load")

    verified: Dict[str, Any] = {}

    def check(name: str, out: Any) -> None:
        if name in verified:
            return
        got = target if name == "shmckpt_load_into" else out
        def same(x: torch.Tensor, y: torch.Tensor) -> bool:  # bytes, so NaNs compare too
            return x.dtype == y.dtype and x.shape == y.shape and torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))

        bad = [k for k, v in state.items() if k not in got or not same(got[k], v)]
        verified[name] = "exact" if not bad else f"MISMATCH in {len(bad)} tensors, e.g. {bad[:3]}"

    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device=dev) if cuda else None
    order = list(methods) + ["raw_read_1", "raw_read_16"] + (["h2d_pinned"] if cuda else [])
    for rep in range(a.load_reps):
        seq = order if rep % 2 == 0 else list(reversed(order))
        if rep == 0:
            # Did the eviction work? A buffered read right after it runs at disk speed
            # only if the page cache really was dropped.
            seq = ["buffered_read_1"] + seq
        for name in seq:
            est = 0.5 if name == "h2d_pinned" else read_est * (2 if name in ("torch_load", "dcp_load_filesystemreader") else 1)
            if not bud.allows(est):
                rec.setdefault("skipped", []).append(f"{name} rep {rep}: budget")
                continue
            try:
                if name == "h2d_pinned":
                    rec["runs"].setdefault(name, []).append(pinned.h2d(dev_flat, dev))
                    continue
                ctx.evictor.evict(*files_of.get(name, [path]))
                if name.startswith(("raw_read", "buffered_read")):
                    r = raw_read(path, int(name.rsplit("_", 1)[1]), want_direct=name.startswith("raw"))
                    if name.startswith("buffered_read"):
                        rec["runs"].setdefault(name, []).append(r["s"])
                        continue
                    rec["runs"].setdefault(name, []).append(r["s"])
                    rec["raw_read_direct"] = r["direct"]
                    continue
                sync(dev)
                t = time.perf_counter()
                out = methods[name]()
                sync(dev)
                dt = time.perf_counter() - t
                rec["runs"].setdefault(name, []).append(dt)
                check(name, out)
                del out
                gc.collect()
            except Exception:
                rec.setdefault("errors", {})[name] = traceback.format_exc()
            ctx.res.flush()
    rec["verified"] = verified
    rec["page_cache"] = ctx.evictor.record()
    s: Dict[str, Any] = {k: med(v) for k, v in rec["runs"].items()}
    raw = [x for x in (s.get("raw_read_1"), s.get("raw_read_16")) if x]
    s["raw_read_best_s"] = min(raw) if raw else None
    # The eviction worked when a buffered read after it is no faster than ~the disk.
    b = s.get("buffered_read_1")
    s["page_cache_drop_effective"] = None if b is None or not raw else b >= 0.7 * min(raw)
    for k in list(rec["runs"]):
        s[f"{k}_gbps"] = gbps(nbytes, s[k])
        if not k.startswith("raw_read") and k != "h2d_pinned":
            s[f"{k}_over_raw_read"] = ratio(s[k], s["raw_read_best_s"])
    s.pop("buffered_read_1_over_raw_read", None)
    for k in ("shmckpt_load", "shmckpt_load_into"):
        for o in ("safetensors_load_file", "torch_load", "safetensors_fast_cuda_env", "dcp_load_filesystemreader"):
            if s.get(k) and s.get(o):
                s[f"{k}_over_{o}"] = s[k] / s[o]
    rec["summary"] = s
    if s.get("dcp_load_shmckptreader") and s.get("dcp_load_filesystemreader"):
        s["dcp_load_shmckptreader_over_dcp_load_filesystemreader"] = s["dcp_load_shmckptreader"] / s["dcp_load_filesystemreader"]
    if os.path.exists(tpath):
        os.remove(tpath)
    import shutil

    for d in dcp_dirs:
        shutil.rmtree(d, ignore_errors=True)
