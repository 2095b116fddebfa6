"""anchors: the physical references of the same bytes on the same machine:
raw O_DIRECT sequential write + fsync, plain pinned D2H copy."""

import gc
import mmap
import os
import statistics

from peers import now

from anchors_state import MiB
from anchors_util import gbps


# ----------------------------------------------------------------------------
# physical references
# ----------------------------------------------------------------------------
def raw_write_ref(path, nbytes, chunk=64 * MiB):
    """Sequential write of nbytes (rounded up to 4 KiB) with O_DIRECT from a
    page-aligned buffer in 64 MiB writes, then fsync. Falls back to buffered
    writes + fsync if the filesystem refuses O_DIRECT (reported)."""
    import numpy as np

    total = (nbytes + 4095) // 4096 * 4096
    buf = mmap.mmap(-1, chunk)
    buf.write(np.random.default_rng(7).integers(0, 256, chunk, dtype=np.uint8).tobytes())
    mv = memoryview(buf)
    direct = True
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        direct = False
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = now()
        remaining = total
        first = True
        while remaining > 0:
            n = min(chunk, remaining)
            try:
                w = os.write(fd, mv[:n])
            except OSError:
                if first and direct:  # EINVAL: O_DIRECT not supported here
                    os.close(fd)
                    direct = False
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    t0 = now()
                    remaining = total
                    continue
                raise
            first = False
            if w <= 0:
                raise OSError("short write")
            remaining -= w
        t_write = now() - t0
        os.fsync(fd)
        secs = now() - t0
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        mv.release()
        buf.close()
    return {
        "bytes": total,
        "seconds": secs,
        "write_seconds_before_fsync": t_write,
        "gbps": gbps(total, secs),
        "o_direct": direct,
    }


def d2h_ref(raws, nbytes, repeats=3):
    """Plain pinned D2H copy of the same bytes: one pinned uint8 buffer
    (torch.empty(pin_memory=True)), copy_(non_blocking=True) of every tensor
    into its slice, torch.cuda.synchronize(); warm once, median of `repeats`."""
    import torch

    t0 = now()
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    alloc_s = now() - t0
    offs = []
    o = 0
    for r in raws:
        offs.append(o)
        o += r.numel()

    def once():
        torch.cuda.synchronize()
        t = now()
        for r, off in zip(raws, offs):
            dst[off : off + r.numel()].copy_(r, non_blocking=True)
        torch.cuda.synchronize()
        return now() - t

    warm = once()
    runs = [once() for _ in range(repeats)]
    med = statistics.median(runs)
    dst = None  # noqa: F841 (frees the pinned buffer; `once` holds the cell)
    gc.collect()
    try:
        torch._C._host_emptyCache()
    except Exception:
        pass
    return {
        "bytes": nbytes,
        "pinned_alloc_seconds": alloc_s,
        "warm_seconds": warm,
        "runs_seconds": runs,
        "seconds": med,
        "gbps": gbps(nbytes, med),
    }
