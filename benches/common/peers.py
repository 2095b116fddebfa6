"""Helpers shared by the benchmark drivers (`benches/anchors/anchors.py`,
`benches/train/train.py`): logging with a run clock, fsync of a peer's output file,
the NVRx worker's failure-safe close, and the run's machine facts.

The drivers import it with ``sys.path.insert(0, <benches/common>)``; it needs nothing
beyond the standard library (the NVRx objects are passed in).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any, Callable, Dict, Optional, TextIO

_T0 = time.monotonic()
_LOG: Optional[TextIO] = None


def set_log_file(f: Optional[TextIO]) -> None:
    """Mirror every later `log` line into ``f`` (None stops it)."""
    global _LOG
    _LOG = f


def elapsed() -> float:
    """Seconds since this module was imported (the run clock of the log lines)."""
    return time.monotonic() - _T0


def log(msg: str) -> None:
    """Print ``msg`` with the UTC time and the run clock, and mirror it to the log file."""
    ts = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    line = f"[{ts} +{elapsed():7.1f}s] {msg}"
    print(line, flush=True)
    if _LOG is not None:
        try:
            _LOG.write(line + "\n")
            _LOG.flush()
        except OSError:
            pass


def now() -> float:
    """The clock every duration is measured with."""
    return time.perf_counter()


def fsync_path(path: str) -> None:
    """fsync a file a peer wrote without syncing it (torch.save, NVRx's worker)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_port() -> int:
    """A free TCP port on the loopback (for a one-process torch.distributed group)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def fs_type_of(path: str) -> Dict[str, Any]:
    """The mount point, filesystem type and device that hold ``path``."""
    path = os.path.realpath(path)
    best, best_type, best_dev = "", None, None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                dev, mnt, typ = parts[0], parts[1].replace("\\040", " "), parts[2]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/") or mnt == "/") and len(mnt) >= len(best):
                    best, best_type, best_dev = mnt, typ, dev
    except OSError:
        pass
    return {"mount": best, "fstype": best_type, "device": best_dev}


def pkg_version(*names: str) -> Optional[str]:
    """The installed version of the first of ``names`` that is installed, else None."""
    from importlib import metadata

    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def raise_nofile() -> Dict[str, Any]:
    """Raise the soft RLIMIT_NOFILE to the hard one: torch.multiprocessing passes every
    shared CPU storage as a file descriptor, and a 1,000-tensor state needs more than the
    usual 1,024."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
        if soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return {"before": soft, "after": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "hard": hard}
    except (ImportError, OSError, ValueError) as e:
        return {"error": repr(e)}


def nvrx_close(queue: Any, close_fn: Callable[[], None]) -> None:
    """Close an NVRx `AsyncCallsQueue`: normally when every save was finalized. After a
    failure (a timeout, a dead worker) the library's blocking close would wait forever for
    the unfinished save, so the worker is terminated instead."""
    caller = getattr(queue, "persistent_caller", None)
    proc = getattr(caller, "process", None)
    if queue.get_num_unfinalized_calls() == 0:
        close_fn()
        return
    log("    NVRx: unfinalized save left after a failure; terminating the worker")
    if proc is not None:
        proc.terminate()
        proc.join(timeout=10)
        caller.process = None
    # A feeder thread may be stuck writing into a pipe nobody reads any more; without
    # this, interpreter exit would join it forever.
    for qname in ("queue", "preload_q", "comp_q"):
        mpq = getattr(caller, qname, None)
        if mpq is not None and hasattr(mpq, "cancel_join_thread"):
            try:
                mpq.cancel_join_thread()
            except Exception:  # noqa: BLE001 - best effort on a broken worker's queues
                pass
    queue.async_calls.clear()
