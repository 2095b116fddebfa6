#!/usr/bin/env python3
"""Python-level benchmark of the shmckpt package against its physical limits (issue 11).

For each state (``8g``: 8 GiB in 64 bf16 tensors; ``16g``: 16 GiB in 1,000 tensors of the
CLI's ``--dtype mixed`` layout; ``tiny``: a few MiB, for a CPU smoke test) it measures, in
one process and with A/B alternation:

1. ``stall``: wall time of a blocking ``Checkpointer.save`` against the Rust CLI
   (``shmckpt bench --layout``, same tensors) and against a plain pinned D2H copy of the
   same bytes measured here; GPU memory counters around every save (``memory``).
2. ``load``: ``Checkpointer.load(map_location=dev)`` and ``load_into`` against
   ``safetensors.torch.load_file`` of the same file, ``torch.load`` of a ``torch.save`` of
   the same state, a raw O_DIRECT read of the file (1 stream and 16 in flight) and a
   pinned H2D copy; the page cache is dropped before every file read when possible.
3. ``guard``: non-blocking save under ``guard(opt)`` in a fake training step (AdamW over
   the state's floating tensors, matmul-heavy fake forward/backward): how long
   ``opt.step()`` waits in the guard's pre-hook.

Results go to ``OUT/py_bench.json`` and ``OUT/py_bench.md``, rewritten after every
measurement, so a run cut short keeps what it measured. Sections that fail record their
traceback and the others go on. See benches/python/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

GiB = 1 << 30
MiB = 1 << 20

ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F16": torch.float16,
    "I64": torch.int64,
    "U8": torch.uint8,
}
MIXED_CYCLE = ["BF16", "F32", "F16", "BF16", "I64", "U8", "F32", "BF16"]


# ----------------------------------------------------------------------------- layouts
def uniform_layout(total: int, n: int, dtype: str) -> List[Dict[str, Any]]:
    """As src/synthetic.rs `uniform` for sizes that divide evenly (8 GiB / 64 bf16)."""
    esize = torch.tensor([], dtype=ST_DTYPES[dtype]).element_size()
    elems = total // n // esize
    # 2-D when square (8192 x 8192 for 128 MiB of bf16), so the matmul view is natural.
    side = int(elems**0.5)
    shape = [side, side] if side * side == elems else [elems]
    return [{"name": f"layers.{i}.weight", "dtype": dtype, "shape": shape} for i in range(n)]


def mixed_layout(total: int, n: int) -> List[Dict[str, Any]]:
    """The exact layout of src/synthetic.rs `mixed` (`shmckpt bench --dtype mixed`)."""
    w = [1 + (i * 2_654_435_761) % 97 for i in range(n)]
    s = sum(w)
    out = []
    for i in range(n):
        d = MIXED_CYCLE[i % 8]
        esize = torch.tensor([], dtype=ST_DTYPES[d]).element_size()
        elems = (total * w[i] // s) // esize
        out.append({"name": f"layers.{i}.weight", "dtype": d, "shape": [elems]})
    return out


STATES = {
    "8g": lambda: uniform_layout(8 * GiB, 64, "BF16"),
    "16g": lambda: mixed_layout(16 * GiB, 1000),
    "tiny": lambda: mixed_layout(8 * MiB, 24),
    "1g": lambda: mixed_layout(1 * GiB, 200),
}


def layout_bytes(layout: List[Dict[str, Any]]) -> int:
    tot = 0
    for e in layout:
        n = 1
        for d in e["shape"]:
            n *= d
        tot += n * torch.tensor([], dtype=ST_DTYPES[e["dtype"]]).element_size()
    return tot


def build_state(layout: List[Dict[str, Any]], device: str, seed: int = 0) -> Dict[str, torch.Tensor]:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    state: Dict[str, torch.Tensor] = {}
    for e in layout:
        dt = ST_DTYPES[e["dtype"]]
        if dt.is_floating_point:
            t = torch.randn(e["shape"], dtype=dt, device=device, generator=g)
        elif dt == torch.uint8:
            t = torch.randint(0, 256, e["shape"], dtype=dt, device=device, generator=g)
        else:
            t = torch.randint(-(2**40), 2**40, e["shape"], dtype=dt, device=device, generator=g)
        state[e["name"]] = t
    return state


# ----------------------------------------------------------------------------- helpers
def med(xs: List[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def gbps(nbytes: int, s: Optional[float]) -> Optional[float]:
    return None if not s else nbytes / s / 1e9


def fmt(x: Any, nd: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


class Budget:
    def __init__(self, seconds: float):
        self.t0 = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def allows(self, est_s: float) -> bool:
        return self.left() > est_s


class Results:
    """The JSON document, rewritten (atomically) with its markdown after every change."""

    def __init__(self, out_dir: str, meta: Dict[str, Any]):
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.doc: Dict[str, Any] = {"meta": meta, "states": {}}

    def state(self, name: str) -> Dict[str, Any]:
        return self.doc["states"].setdefault(name, {})

    def flush(self) -> None:
        for fname, text in (
            ("py_bench.json", json.dumps(self.doc, indent=1, default=str)),
            ("py_bench.md", render_markdown(self.doc)),
        ):
            p = os.path.join(self.out_dir, fname)
            with open(p + ".tmp", "w") as f:
                f.write(text)
            os.replace(p + ".tmp", p)


def log(msg: str) -> None:
    print(f"[py_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def mem_snapshot(device: str) -> Optional[Dict[str, int]]:
    if not device.startswith("cuda"):
        return None
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "free": free,
        "total": total,
    }


class Evictor:
    """Drops a file from the page cache before a timed read: fsync + POSIX_FADV_DONTNEED
    on the file, and `echo 3 > /proc/sys/vm/drop_caches` (root only; may fail in a
    sandbox). Records what worked."""

    def __init__(self) -> None:
        self.drop_caches_ok: Optional[bool] = None
        self.drop_caches_error: Optional[str] = None
        self.fadvise_ok: Optional[bool] = None
        self.fadvise_error: Optional[str] = None

    def evict(self, *paths: str) -> None:
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                self.fadvise_ok = True if self.fadvise_ok is None else self.fadvise_ok
            except OSError as e:
                self.fadvise_ok = False
                self.fadvise_error = repr(e)
        if self.drop_caches_ok is False:
            return
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            self.drop_caches_ok = True
        except OSError as e:
            self.drop_caches_ok = False
            self.drop_caches_error = repr(e)

    def record(self) -> Dict[str, Any]:
        return {
            "drop_caches_ok": self.drop_caches_ok,
            "drop_caches_error": self.drop_caches_error,
            "fadvise_dontneed_ok": self.fadvise_ok,
            "fadvise_error": self.fadvise_error,
        }


def raw_read(path: str, streams: int, chunk: int = 16 * MiB, want_direct: bool = True) -> Dict[str, Any]:
    """Read the whole file with O_DIRECT (buffered if the filesystem refuses it) in
    `chunk` requests, `streams` of them in flight (one thread each, reused aligned
    buffers), as the disk's read limit."""
    size = os.path.getsize(path)
    direct = want_direct
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if want_direct else 0))
    except OSError:
        direct = False
        fd = os.open(path, os.O_RDONLY)
    nchunks = (size + chunk - 1) // chunk
    errors: List[str] = []
    total = [0] * streams

    def worker(k: int) -> None:
        buf = mmap.mmap(-1, chunk)
        try:
            for i in range(k, nchunks, streams):
                n = os.preadv(fd, [buf], i * chunk)
                total[k] += n
        except OSError as e:  # pragma: no cover - reported
            errors.append(repr(e))
        finally:
            buf.close()

    try:
        t = time.perf_counter()
        if streams == 1:
            worker(0)
        else:
            th = [threading.Thread(target=worker, args=(k,)) for k in range(streams)]
            for x in th:
                x.start()
            for x in th:
                x.join()
        dt = time.perf_counter() - t
    finally:
        os.close(fd)
    if errors:
        raise OSError(f"raw read of {path}: {errors[0]}")
    if sum(total) != size:
        raise OSError(f"raw read of {path}: {sum(total)} bytes read of {size}")
    return {"s": dt, "direct": direct}


# ----------------------------------------------------------------------------- context
class Ctx:
    def __init__(self, args: argparse.Namespace, res: Results, budget: Budget):
        self.args = args
        self.res = res
        self.budget = budget
        self.device = args.device
        self.evictor = Evictor()


def run_section(ctx: Ctx, sname: str, section: str, fn: Callable[[Dict[str, Any]], None]) -> None:
    rec = ctx.res.state(sname).setdefault(section, {})
    log(f"{sname}: {section} (budget left {ctx.budget.left():.0f} s)")
    t = time.monotonic()
    try:
        fn(rec)
    except Exception:
        rec["error"] = traceback.format_exc()
        log(f"{sname}: {section} FAILED:\n{rec['error']}")
    finally:
        rec["section_s"] = time.monotonic() - t
        ctx.res.flush()
        gc.collect()
        if ctx.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the benchmark's own leftovers only


class Pinned:
    """One flat host buffer (pinned on CUDA) of the state's bytes, and per-tensor uint8
    views of it: the plain-copy references."""

    def __init__(self, state: Dict[str, torch.Tensor], device: str):
        self.nbytes = sum(t.numel() * t.element_size() for t in state.values())
        cuda = device.startswith("cuda")
        self.buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.views = []
        off = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            self.views.append((self.buf[off : off + n], t))
            off += n

    def d2h(self, device: str) -> float:
        sync(device)
        t = time.perf_counter()
        for dst, src in self.views:
            dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
        sync(device)
        return time.perf_counter() - t

    def h2d(self, dev_flat: torch.Tensor, device: str) -> float:
        sync(device)
        t = time.perf_counter()
        dev_flat.copy_(self.buf, non_blocking=True)
        sync(device)
        return time.perf_counter() - t


# ----------------------------------------------------------------------------- 1. stall
def section_stall(ctx: Ctx, sname: str, st: Dict[str, Any], rec: Dict[str, Any]) -> None:
    a, dev, bud = ctx.args, ctx.device, ctx.budget
    state, ckpt, pinned, nbytes = st["state"], st["ckpt"], st["pinned"], st["nbytes"]
    save_est = nbytes / (a.disk_gbps * 1e9) + 0.5
    rec.update(bytes=nbytes, tensors=len(state), py_runs=[], d2h_runs_s=[], cli_blocks=[], memory_runs=[])
    pinned.d2h(dev)  # warm-up: first touch of the pinned pages
    if dev.startswith("cuda"):
        rec["prepare_cuda_s"] = ckpt.prepare_cuda()

    def py_block(n: int, warm: bool) -> None:
        for i in range(n):
            if not bud.allows(save_est):
                rec.setdefault("skipped", []).append("python save: budget")
                return
            rec["d2h_runs_s"].append(pinned.d2h(dev))
            m0 = mem_snapshot(dev)
            step = st["next_step"]
            st["next_step"] += 1
            sync(dev)
            t = time.perf_counter()
            h = ckpt.save(step, state)
            stall = time.perf_counter() - t
            m1 = mem_snapshot(dev)
            rep = h.wait()
            m2 = mem_snapshot(dev)
            st["last_step"] = step
            st["last_file"] = rep.get("file")
            rec["py_runs"].append(
                {
                    "step": step,
                    "warmup": warm and i == 0,
                    "stall_s": stall,
                    "report": {k: v for k, v in rep.items() if isinstance(v, (int, float, str, bool))},
                }
            )
            if m0 is not None:
                rec["memory_runs"].append({"before": m0, "staged": m1, "durable": m2})
            ctx.res.flush()

    def cli_block(n: int) -> None:
        cli = a.cli
        if not cli or not os.path.exists(cli):
            rec.setdefault("skipped", []).append(f"CLI: binary {cli!r} not found")
            return
        est = (n + 1) * save_est + nbytes / 3e9 + 5
        if not bud.allows(est):
            rec.setdefault("skipped", []).append(f"CLI block: budget (needs ~{est:.0f} s)")
            return
        d = os.path.join(a.root, f"cli-{sname}")
        shutil.rmtree(d, ignore_errors=True)
        cmd = [cli, "bench", "--source", "cuda" if dev.startswith("cuda") else "host",
               "--layout", st["layout_path"], "--repeat", str(n), "--json",
               "--no-reference", "--dir", d]
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, bud.left()))
        finally:
            shutil.rmtree(d, ignore_errors=True)
        blk: Dict[str, Any] = {"cmd": " ".join(cmd), "rc": p.returncode, "wall_s": time.monotonic() - t}
        if p.returncode != 0:
            blk["stderr_tail"] = p.stderr[-3000:]
            blk["stdout_tail"] = p.stdout[-2000:]
        else:
            blk["json"] = parse_cli_json(p.stdout)
        rec["cli_blocks"].append(blk)
        ctx.res.flush()

    def guarded(fn: Callable[..., None], *args: Any, **kw: Any) -> None:
        try:
            fn(*args, **kw)
        except Exception:
            rec.setdefault("block_errors", []).append(traceback.format_exc())
            log(f"{sname}: stall block failed:\n{rec['block_errors'][-1]}")

    k = a.py_per_block
    guarded(py_block, k + 1, warm=True)   # A (first save is a warm-up: fresh staging pages)
    for _ in range(max(1, a.cli_blocks)):
        guarded(cli_block, a.cli_repeat)  # B
        guarded(py_block, k, warm=False)  # A

    # Summary.
    py = [r["stall_s"] for r in rec["py_runs"] if not r["warmup"]]
    cli_runs: List[float] = []
    cli_d2h: List[float] = []
    for b in rec["cli_blocks"]:
        j = b.get("json")
        if j:
            cli_runs += [r["stall_s"] for r in j.get("runs", [])][1:] or [r["stall_s"] for r in j.get("runs", [])]
            cli_d2h += j.get("d2h_runs_s", []) or []
    s = {
        "py_stall_s": med(py),
        "py_stall_first_s": rec["py_runs"][0]["stall_s"] if rec["py_runs"] else None,
        "py_engine_staging_s": med([r["report"].get("staging") for r in rec["py_runs"] if not r["warmup"] and "staging" in r["report"]]),
        "cli_stall_s": med(cli_runs),
        "cli_d2h_s": med(cli_d2h),
        "d2h_s": med(rec["d2h_runs_s"]),
        "py_durable_s": med([r["report"].get("durable") for r in rec["py_runs"] if "durable" in r["report"]]),
    }
    s["d2h_gbps"] = gbps(nbytes, s["d2h_s"])
    s["py_over_cli"] = ratio(s["py_stall_s"], s["cli_stall_s"])
    s["py_over_d2h"] = ratio(s["py_stall_s"], s["d2h_s"])
    s["cli_over_d2h"] = ratio(s["cli_stall_s"], s["d2h_s"])
    s["goal_py_over_cli_1_05_met"] = None if s["py_over_cli"] is None else s["py_over_cli"] <= 1.05
    if rec["memory_runs"]:
        unchanged = all(
            m["before"]["allocated"] == m["staged"]["allocated"] == m["durable"]["allocated"]
            and m["before"]["reserved"] == m["staged"]["reserved"] == m["durable"]["reserved"]
            for m in rec["memory_runs"]
        )
        s["memory_unchanged_by_save"] = unchanged
        s["max_free_drop_during_save_bytes"] = max(
            max(m["before"]["free"] - m["staged"]["free"], m["before"]["free"] - m["durable"]["free"])
            for m in rec["memory_runs"]
        )
    rec["summary"] = s


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


def parse_cli_json(out: str) -> Dict[str, Any]:
    """The JSON object `shmckpt bench --json` prints (the first one starting a line)."""
    dec = json.JSONDecoder()
    for i, c in enumerate(out):
        if c == "{" and (i == 0 or out[i - 1] == "\n"):
            try:
                obj, _ = dec.raw_decode(out, i)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    raise ValueError(f"no JSON object in the CLI output: {out[-500:]!r}")


def locate_file(ckpt: Any, step: int) -> str:
    """The rank file of `step`: from the manifest when it names it, else by walking."""
    try:
        man = ckpt.manifest(step)
        files = man.get("files") if isinstance(man, dict) else None
        for f in files or []:
            p = f.get("path") or f.get("file") or f.get("name") if isinstance(f, dict) else f
            if isinstance(p, str):
                for cand in (p, os.path.join(ckpt.root, p)):
                    if os.path.isfile(cand):
                        return cand
                for dp, _d, fs in os.walk(ckpt.root):
                    if os.path.basename(p) in fs and str(step) in dp:
                        return os.path.join(dp, os.path.basename(p))
    except Exception:
        pass
    cands = []
    for dp, _d, fs in os.walk(ckpt.root):
        for f in fs:
            if f.endswith(".safetensors") and "rank-" in f:
                digits = "".join(c for c in os.path.basename(dp) if c.isdigit())
                if digits and int(digits) == step:
                    cands.append(os.path.join(dp, f))
    if len(cands) != 1:
        raise FileNotFoundError(f"rank file of step {step} under {ckpt.root}: candidates {cands}")
    return cands[0]


# ----------------------------------------------------------------------------- 2. guard
def section_guard(ctx: Ctx, sname: str, st: Dict[str, Any], rec: Dict[str, Any]) -> None:
    a, dev, bud = ctx.args, ctx.device, ctx.budget
    state = st["state"]
    cuda = dev.startswith("cuda")
    params = {k: v for k, v in state.items() if v.is_floating_point()}
    pbytes = sum(v.numel() * v.element_size() for v in params.values())
    save_est = pbytes / (a.disk_gbps * 1e9) + 0.5
    if not bud.allows(3 * save_est + 10):
        rec.setdefault("skipped", []).append(f"guard: budget (needs ~{3 * save_est + 10:.0f} s)")
        return
    # The pinned copy of exactly the saved bytes (the guarded parameters).
    ref = st["pinned"] if len(params) == len(state) else Pinned(params, dev)
    ref.d2h(dev)
    copies = [ref.d2h(dev) for _ in range(3)]
    copy_s = med(copies)
    rec.update(saved_bytes=pbytes, saved_tensors=len(params), pinned_copy_runs_s=copies, pinned_copy_s=copy_s)
    del ref
    st["dirty"] = True  # opt.step() changes the state after its last save
    try:
        _guard_body(ctx, st, rec, params, pbytes, save_est, copy_s, cuda)
    finally:
        for p in params.values():
            p.grad = None
            p.requires_grad_(False)


def _guard_body(ctx: Ctx, st: Dict[str, Any], rec: Dict[str, Any], params: Dict[str, torch.Tensor],
                pbytes: int, save_est: float, copy_s: Optional[float], cuda: bool) -> None:
    a, dev, bud, ckpt = ctx.args, ctx.device, ctx.budget, st["ckpt"]
    for p in params.values():
        p.requires_grad_(True)
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(list(params.values()), lr=1e-6, foreach=True)
    opt.step()  # allocate exp_avg / exp_avg_sq
    sync(dev)
    rec["optimizer"] = "AdamW(foreach=True), state allocated by one step before timing"
    n = a.mm_size
    A = torch.randn(n, n, dtype=torch.bfloat16 if cuda else torch.float32, device=dev)
    B = torch.randn_like(A)
    C = torch.empty_like(A)
    grads = [p.grad for p in params.values()]

    def fwd_bwd(k: int) -> None:
        for _ in range(k):
            torch.matmul(A, B, out=C)
        for g in grads:  # the "backward" writes the gradients
            g.mul_(0.5)

    # Calibrate matmuls per fake forward/backward.
    def timed(k: int) -> float:
        t = time.perf_counter()
        fwd_bwd(k)
        sync(dev)
        return time.perf_counter() - t

    timed(2)
    t_grads = min(timed(0) for _ in range(3))
    t_10 = min(timed(10) for _ in range(3))
    per_mm = max((t_10 - t_grads) / 10, 1e-6)
    rec["calibration"] = {"grads_only_s": t_grads, "ten_matmuls_s": t_10, "per_matmul_s": per_mm}
    hook_t: List[float] = []
    ckpt.guard(opt)
    h_mine = opt.register_step_pre_hook(lambda *_: hook_t.append(time.perf_counter()))
    stream_sync = (lambda: torch.cuda.current_stream().synchronize()) if cuda else (lambda: None)
    targets = [float(x) for x in a.fwd_ms.split(",")] + ([1.3 * copy_s * 1e3] if a.fwd_covering and copy_s else [])
    rec["cases"] = []
    try:
        for target_ms in targets:
            k = max(1, round((target_ms / 1e3 - t_grads) / per_mm))
            case: Dict[str, Any] = {"target_fwd_ms": target_ms, "matmuls": k, "matmul_n": n, "with": [], "without": []}
            rec["cases"].append(case)
            fwd_bwd(k)  # warm
            opt.step()
            sync(dev)
            for rep in range(a.guard_reps):
                for with_save in ((False, True) if rep % 2 == 0 else (True, False)):
                    last_it = max([x["iteration_s"] for x in case["without"]] or [target_ms / 1e3])
                    if not bud.allows(last_it + (save_est if with_save else 0) + 1):
                        rec.setdefault("skipped", []).append(f"target {target_ms} rep {rep}: budget")
                        continue
                    sync(dev)
                    hook_t.clear()
                    h = None
                    m0 = mem_snapshot(dev) if with_save else None
                    t0 = time.perf_counter()
                    if with_save:
                        step = st["next_step"]
                        st["next_step"] += 1
                        h = ckpt.save(step, params, blocking=False)
                    t1 = time.perf_counter()
                    m1 = mem_snapshot(dev) if with_save else None
                    fwd_bwd(k)
                    stream_sync()  # e.g. loss.item(): the host sees the end of the backward
                    t2 = time.perf_counter()
                    staged_before_step = h.staged() if h is not None else None
                    opt.step()
                    t3 = time.perf_counter()
                    stream_sync()
                    t4 = time.perf_counter()
                    r = {
                        "save_call_s": t1 - t0,
                        "fwd_bwd_s": t2 - t1,
                        "step_wait_s": (hook_t[-1] - t2) if hook_t else None,
                        "opt_step_host_s": t3 - t2,
                        "iteration_s": t4 - t0,
                        "staged_before_step": staged_before_step,
                    }
                    if m0 is not None:
                        r["memory_at_save_call"] = {"before": m0, "after": m1}
                    if h is not None:
                        rep_ = h.wait()
                        st["last_step"] = step
                        st["last_file"] = rep_.get("file")
                        r["engine_staging_s"] = rep_.get("staging")
                    case["with" if with_save else "without"].append(r)
                    ctx.res.flush()
            w = lambda key, side: med([x[key] for x in case[side] if x[key] is not None])  # noqa: E731
            wait_with, wait_without = w("step_wait_s", "with"), w("step_wait_s", "without")
            step_with, step_without = w("opt_step_host_s", "with"), w("opt_step_host_s", "without")
            fwd = w("fwd_bwd_s", "without")
            stall = None if step_with is None or step_without is None else max(0.0, step_with - step_without)
            mems = [x["memory_at_save_call"] for x in case["with"] if "memory_at_save_call" in x]
            case["summary"] = {
                "memory_unchanged_by_save_call": None if not mems else all(
                    m["before"]["allocated"] == m["after"]["allocated"] and m["before"]["reserved"] == m["after"]["reserved"]
                    for m in mems),
                "step_wait_s": wait_with,
                "step_wait_no_save_s": wait_without,
                "opt_step_extra_s": stall,
                "iteration_extra_s": None if w("iteration_s", "with") is None or w("iteration_s", "without") is None
                else w("iteration_s", "with") - w("iteration_s", "without"),
                "fwd_bwd_s": fwd,
                "fwd_bwd_with_save_s": w("fwd_bwd_s", "with"),
                "save_call_s": w("save_call_s", "with"),
                "wait_over_pinned_copy": ratio(wait_with, copy_s),
                "lower_bound_s": None if fwd is None or copy_s is None else max(0.0, copy_s - fwd),
                "goal_0_2_met": None if wait_with is None or copy_s is None else wait_with <= 0.2 * copy_s,
            }
            ctx.res.flush()
    finally:
        h_mine.remove()
        ckpt.unguard(opt)
        del opt, A, B, C, grads


# ----------------------------------------------------------------------------- markdown
def render_markdown(doc: Dict[str, Any]) -> str:
    m = doc["meta"]
    L = [f"# shmckpt Python benchmark ({m.get('device_name')}, {m.get('started')})", "",
         f"torch {m.get('torch')}, safetensors {m.get('safetensors')}, shmckpt {m.get('shmckpt')}, "
         f"Python {m.get('python')}; root `{m.get('root')}`; medians of alternated runs.", ""]
    for sname, st in doc["states"].items():
        L.append(f"## {sname}: {st.get('desc', '')}")
        L.append("")
        s = st.get("stall", {}).get("summary")
        if s:
            L += ["| stall | s | GB/s | ratio | goal |", "|---|---|---|---|---|",
                  f"| pinned D2H (this run) | {fmt(s['d2h_s'])} | {fmt(s['d2h_gbps'], 1)} | 1 | |",
                  f"| CLI `shmckpt bench` stall | {fmt(s['cli_stall_s'])} | {fmt(gbps(st['stall']['bytes'], s['cli_stall_s']), 1)} | {fmt(s['cli_over_d2h'], 3)} × D2H | |",
                  f"| Python `save()` wall | {fmt(s['py_stall_s'])} | {fmt(gbps(st['stall']['bytes'], s['py_stall_s']), 1)} | {fmt(s['py_over_d2h'], 3)} × D2H | |",
                  f"| engine staging seen from Python (report `staging`) | {fmt(s['py_engine_staging_s'])} | | {fmt(ratio(s['py_engine_staging_s'], s['cli_stall_s']), 3)} × CLI | |",
                  f"| Python / CLI | | | **{fmt(s['py_over_cli'], 3)}** | ≤ 1.05: {fmt(s['goal_py_over_cli_1_05_met'])} |",
                  f"| Python first save (warm-up) | {fmt(s['py_stall_first_s'])} | | | |",
                  f"| memory_allocated/reserved unchanged by save | {fmt(s.get('memory_unchanged_by_save'))} | | | must be yes |",
                  ""]
        for sec in ("stall", "guard", "load"):
            r = st.get(sec, {})
            if r.get("error"):
                L += [f"**{sec} failed**: `{r['error'].strip().splitlines()[-1]}`", ""]
            if r.get("skipped"):
                L += [f"{sec} skipped: " + "; ".join(r["skipped"]), ""]
        s = st.get("load", {}).get("summary")
        if s:
            nb = st["load"].get("file_bytes")
            L += ["| load | s | GB/s | × raw read | verified |", "|---|---|---|---|---|"]
            for k in st["load"]["runs"]:
                L.append(f"| {k} | {fmt(s.get(k))} | {fmt(gbps(nb, s.get(k)), 2)} | {fmt(s.get(f'{k}_over_raw_read'), 3)} | {st['load'].get('verified', {}).get(k, '')} |")
            pc = st["load"].get("page_cache", {})
            L += ["", f"drop_caches write accepted: {fmt(pc.get('drop_caches_ok'))}; fadvise DONTNEED: {fmt(pc.get('fadvise_dontneed_ok'))}; "
                  f"eviction effective (buffered read after it ≥ 0.7 × raw read): {fmt(s.get('page_cache_drop_effective'))}; "
                  f"raw read O_DIRECT: {fmt(st['load'].get('raw_read_direct'))}", ""]
        g = st.get("guard", {})
        if g.get("cases"):
            L += [f"Guard: {g.get('saved_bytes', 0) / GiB:.2f} GiB of parameters (AdamW), pinned copy {fmt(g.get('pinned_copy_s'))} s", "",
                  "| fake fwd/bwd | wait in opt.step (pre-hook) | × pinned copy | opt.step extra vs no save | lower bound max(0, copy − fwd) | fwd/bwd with save | save() call | iteration extra | device memory unchanged by save() | goal ≤ 0.2 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
            for c in g["cases"]:
                cs = c.get("summary")
                if cs:
                    L.append(f"| {fmt(cs['fwd_bwd_s'])} s | {fmt(cs['step_wait_s'])} s | {fmt(cs['wait_over_pinned_copy'], 3)} | {fmt(cs['opt_step_extra_s'])} s | {fmt(cs['lower_bound_s'])} s | {fmt(cs['fwd_bwd_with_save_s'])} s | {fmt(cs['save_call_s'])} s | {fmt(cs['iteration_extra_s'])} s | {fmt(cs['memory_unchanged_by_save_call'])} | {fmt(cs['goal_0_2_met'])} |")
            L.append("")
    return "\n".join(L) + "\n"


def build_entry(ctx: Ctx, sname: str, srec: Dict[str, Any]) -> Dict[str, Any]:
    a, dev = ctx.args, ctx.device
    layout = STATES[sname]()
    nbytes = layout_bytes(layout)
    dts = "/".join(sorted({e["dtype"] for e in layout}))
    srec["desc"] = f"{nbytes / GiB:.2f} GiB in {len(layout)} tensors ({dts}) on {dev}"
    lp = os.path.join(a.out, f"layout-{sname}.json")
    with open(lp, "w") as f:
        json.dump(layout, f)
    t = time.perf_counter()
    state = build_state(layout, dev)
    sync(dev)
    srec["fill_s"] = time.perf_counter() - t
    t = time.perf_counter()
    pinned = Pinned(state, dev)
    srec["pinned_alloc_s"] = time.perf_counter() - t
    srec["memory_after_alloc"] = mem_snapshot(dev)
    return {"state": state, "nbytes": nbytes, "layout_path": lp, "pinned": pinned}


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--state", "--states", dest="states", default="8g,16g", help="comma list of " + ",".join(STATES))
    ap.add_argument("--sections", default="stall,load,guard", help="comma list of stall,load,guard (memory is recorded in stall)")
    ap.add_argument("--guard-states", default="8g,tiny,1g", help="states the guard section runs on")
    ap.add_argument("--load-states", default="8g,16g,tiny,1g", help="states the load section runs on")
    ap.add_argument("--root", default=None, help="checkpoint root on the disk to measure (default: ./py-bench-root)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "py-bench-out")
    ap.add_argument("--cli", default="target/release/shmckpt", help="the shmckpt CLI binary")
    ap.add_argument("--budget-s", type=float, default=280.0)
    ap.add_argument("--py-per-block", type=int, default=2, help="Python saves per A block")
    ap.add_argument("--cli-repeat", type=int, default=3, help="--repeat of each CLI block (its first run is dropped)")
    ap.add_argument("--cli-blocks", type=int, default=1)
    ap.add_argument("--load-reps", type=int, default=2)
    ap.add_argument("--guard-reps", type=int, default=3)
    ap.add_argument("--fwd-ms", default=None, help="fake forward/backward targets, ms (comma list; default 80 on cuda, 10 on cpu)")
    ap.add_argument("--fwd-covering", dest="fwd_covering", action="store_true", default=None,
                    help="also a case whose forward/backward is 1.3 x the pinned copy (default on cuda)")
    ap.add_argument("--no-fwd-covering", dest="fwd_covering", action="store_false")
    ap.add_argument("--mm-size", type=int, default=0, help="matmul side (default 8192 cuda, 256 cpu)")
    ap.add_argument("--no-torch-load", dest="torch_load", action="store_false")
    ap.add_argument("--no-dcp-load", dest="dcp_load", action="store_false", help="skip the DCP loads (FileSystemReader, ShmckptReader)")
    ap.add_argument("--no-safetensors-fast", dest="safetensors_fast", action="store_false")
    ap.add_argument("--disk-gbps", type=float, default=2.0, help="write speed assumed by the budget")
    ap.add_argument("--read-gbps", type=float, default=2.0, help="read speed assumed by the budget")
    a = ap.parse_args()
    if a.fwd_ms is None:
        a.fwd_ms = "80" if a.device == "cuda" else "10"
    if a.fwd_covering is None:
        a.fwd_covering = a.device == "cuda"
    if not a.mm_size:
        a.mm_size = 8192 if a.device == "cuda" else 256
    a.root = os.path.abspath(a.root or "py-bench-root")
    a.cli = os.path.abspath(a.cli) if a.cli else a.cli
    os.makedirs(a.root, exist_ok=True)
    budget = Budget(a.budget_s)

    import shmckpt

    try:
        import safetensors
        st_ver = safetensors.__version__
    except Exception as e:  # noqa: BLE001
        st_ver = f"unavailable: {e!r}"
    dev = "cuda:0" if a.device == "cuda" else "cpu"
    if dev.startswith("cuda"):
        torch.cuda.set_device(0)
    meta = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv,
        "args": vars(a),
        "device": dev,
        "device_name": torch.cuda.get_device_name(0) if dev.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__,
        "safetensors": st_ver,
        "shmckpt": getattr(shmckpt, "__version__", "?"),
        "shmckpt_file": shmckpt.__file__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "root": a.root,
        "cli": a.cli,
        "skipped": [],
    }
    res = Results(a.out, meta)
    ctx = Ctx(a, res, budget)
    ctx.device = dev
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    if not dev.startswith("cuda"):
        meta["skipped"].append("CUDA-only parts (pinned memory, prepare_cuda, H2D, GPU memory counters, "
                               "safetensors fast CUDA path): --device cpu; the references are plain host copies")
    res.flush()

    # The plan: first the stall (and guard) of every state, then the loads, so the
    # budget goes to the stalls first. States stay allocated between their items; each
    # item opens its own checkpointer (fresh root) and removes it after, so the disk
    # holds at most one state's checkpoints plus the CLI's.
    states = [x.strip() for x in a.states.split(",") if x.strip()]
    plan: List[Any] = []
    for sname in states:
        secs = [x for x in ("stall", "guard") if x in sections and (x != "guard" or sname in a.guard_states.split(","))]
        if secs:
            plan.append((sname, secs))
    for sname in states:
        if "load" in sections and sname in a.load_states.split(","):
            plan.append((sname, ["load"]))
    meta["plan"] = plan
    last_use = {sname: i for i, (sname, _) in enumerate(plan)}
    cache: Dict[str, Dict[str, Any]] = {}
    for idx, (sname, secs) in enumerate(plan):
        srec = res.state(sname)
        if budget.left() < 10:
            srec.setdefault("skipped", []).append(f"{','.join(secs)}: budget")
            res.flush()
            continue
        st = cache.get(sname)
        try:
            if st is None:
                st = cache[sname] = build_entry(ctx, sname, srec)
            root = os.path.join(a.root, f"py-{sname}")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            t = time.perf_counter()
            st["ckpt"] = shmckpt.Checkpointer(root, keep_last=1, staging_capacity=st["nbytes"] + 64 * MiB + 8 * MiB)
            srec.setdefault("checkpointer_open_s", []).append(time.perf_counter() - t)
            st.update(next_step=1, last_step=None, last_file=None, dirty=False)
            res.flush()
        except Exception:
            srec.setdefault("setup_errors", []).append(traceback.format_exc())
            log(f"{sname}: setup FAILED\n{srec['setup_errors'][-1]}")
            res.flush()
            cache.pop(sname, None)
            st = None
            gc.collect()
            continue
        try:
            for sec in secs:
                fn = {"stall": section_stall, "guard": section_guard, "load": section_load}[sec]
                run_section(ctx, sname, sec, lambda r, fn=fn: fn(ctx, sname, st, r))
        finally:
            try:
                st.pop("ckpt").close()
            except Exception:
                srec.setdefault("close_errors", []).append(traceback.format_exc())
            shutil.rmtree(os.path.join(a.root, f"py-{sname}"), ignore_errors=True)
            if last_use[sname] == idx:
                cache.pop(sname, None)
                st = None
                gc.collect()
                if dev.startswith("cuda"):
                    torch.cuda.empty_cache()
                    srec["memory_after_free"] = mem_snapshot(dev)
            res.flush()
    res.doc["meta"]["wall_s"] = budget.seconds - budget.left()
    res.flush()
    log(f"done in {res.doc['meta']['wall_s']:.1f} s; {os.path.join(a.out, 'py_bench.md')}")
    sys.stdout.write(render_markdown(res.doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
