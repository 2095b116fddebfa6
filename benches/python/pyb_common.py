"""py_bench.py: constants, state layouts, numeric helpers, the budget, page-cache
eviction, raw reads, the pinned reference copies and CLI/file helpers."""

from __future__ import annotations

import json
import mmap
import os
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Optional

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


# ----------------------------------------------------------------------------- CLI output, files
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

