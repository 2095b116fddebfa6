"""The opt-in device snapshot of a guarded non-blocking save (``save(..., snapshot="device")``).

A guarded non-blocking save of CUDA tensors copies them to the host while the trainer runs
its next forward and backward; the guard makes the optimizer step wait (on the device) for
those copies. With ``snapshot="device"`` the engine keeps most of the copy unqueued (at most
256 MiB ahead of completion), and the guard, when the optimizer step starts, asks it to copy
what is left device-to-device (at device-memory speed) into a transient buffer from a
memory pool of the engine's own, outside torch's caching allocator, allocated for all of
the save's device bytes when the save starts; the optimizer's kernels
then wait for those device-to-device copies only, and the rest goes to the host from the
buffer, whose memory goes back to the device (freed in stream order, the pool trimmed) as
soon as its host copies completed. Its size (the peak extra
device memory of the save) is ``SaveHandle.snapshot_bytes`` and ``snapshot_bytes`` in the
staging and save reports. The default (``snapshot=None``) allocates nothing on the device.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Optional, Sequence, Tuple

from .errors import ConfigError

#: The values ``save(..., snapshot=...)`` accepts.
MODES = (None, "none", "device")


def device_mode(snapshot: Optional[str], blocking: bool, guarded: bool) -> bool:
    """Whether ``snapshot`` asks for the device snapshot, after checking it: ``None`` or
    ``"none"`` (default: no device memory) or ``"device"``, which needs a non-blocking save
    (``blocking=False``) and a guarded optimizer (:meth:`Checkpointer.guard`: the guard is
    what asks for the snapshot when the optimizer step starts)."""
    if snapshot is not None and not isinstance(snapshot, str):
        raise TypeError(f"snapshot must be None, 'none' or 'device', not {type(snapshot).__name__}")
    if snapshot not in MODES:
        raise ValueError(f"snapshot must be None, 'none' or 'device', not {snapshot!r}")
    if snapshot != "device":
        return False
    if blocking:
        raise ValueError("snapshot='device' applies to non-blocking saves (blocking=False)")
    if not guarded:
        raise ConfigError(
            "snapshot='device' needs a guarded optimizer (Checkpointer.guard(optimizer)): "
            "the guard takes the snapshot when the optimizer step starts"
        )
    return True


def hold(rust: Any, snapshot: bool, streams: Sequence[Tuple[int, Any]]) -> int:
    """The guard's device wait for one save (``streams``: ``(device, torch.cuda.Stream)``,
    never an integer handle): with ``snapshot``, ask the engine for the snapshot first, so
    the streams wait only for its device-to-device copies (and the few device-to-host
    copies queued before it); then hold the streams. Returns the snapshot's
    device bytes (0 without one)."""
    if snapshot:
        rust.request_snapshot()
    rust.hold_streams(list(streams))
    return int(rust.snapshot_bytes()) if snapshot else 0


def request_early(started: Optional["concurrent.futures.Future[Any]"]) -> None:
    """The guard's first call for a speculative start with a snapshot (``started``: the
    future of the engine's provisional handle, ``SaveHandle._started``), before the save's
    check: ask that save for its snapshot now, so that the staging thread queues the
    device-to-device copies while the trainer's thread checks the call's tensors (the
    check runs ~13 ms before the copies started, on an H100 trace of 1,168 tensors:
    docs/benchmarks.md). The tensors are not changed before the optimizer step, which
    the guard holds after the check; if the check refuses the save, the snapshot was a
    copy of nothing that is kept, and the save that stands is asked for its own
    (``hold``). Nothing when the start made no save."""
    if started is None:
        return
    try:
        rust = started.result()
    except Exception:
        return  # (``_start`` returns None instead of raising; the check reports it)
    if rust is not None:
        rust.request_snapshot()
