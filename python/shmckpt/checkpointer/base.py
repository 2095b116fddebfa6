"""What the parts of ``Checkpointer`` share: step arguments, the rank and world size from
``torch.distributed``, and :class:`CheckpointerBase`, the state the constructor sets (in
``core.py``) that the save, guard and load mixins read."""

from __future__ import annotations

import concurrent.futures
import operator
import threading
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np

from .handle import SaveHandle

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]

StepArg = Union[int, str, None]


def _dist_barrier() -> None:
    """All ranks' engines are open before any rank saves: opening an engine removes stale
    partial directories of the root when it sees no other live engine, which must not
    race with another rank's first save."""
    import torch.distributed as dist

    dist.barrier()


def _dist_rank_world() -> Tuple[int, int]:
    if torch is not None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return dist.get_rank(), dist.get_world_size()
        except Exception:  # pragma: no cover
            pass
    return 0, 1


def _step_int(step: Any) -> int:
    """``step`` as an int: any integer (numpy's included), never a bool (``True`` is not
    step 1)."""
    if isinstance(step, (bool, np.bool_)):
        raise TypeError(f"step must be an int, not {type(step).__name__} {step!r}")
    return operator.index(step)


def _step_sel(step: StepArg) -> Optional[int]:
    """A step argument of ``load``, ``load_into`` and ``manifest``: ``None`` for
    ``"latest"`` (or ``None``), else the int. Any other string is a ``ValueError`` naming
    it; a bool or a non-integer a ``TypeError``."""
    if step is None or (isinstance(step, str) and step == "latest"):
        return None
    if isinstance(step, str):
        raise ValueError(f"step {step!r} is not a step: give an int (a committed step) or 'latest'")
    if isinstance(step, (bool, np.bool_)):
        raise TypeError(f"step must be an int or 'latest', not {type(step).__name__} {step!r}")
    return operator.index(step)


class CheckpointerBase:
    """The attributes of a :class:`~shmckpt.Checkpointer` (set by its constructor) and the
    bookkeeping of the saves in flight, which the save, guard and load mixins share."""

    rank: int
    world_size: int
    root: str
    remote: Optional[str]
    _engine: Any  # shmckpt._shmckpt.Engine
    _pending: List[SaveHandle]
    _guards: List[Tuple[Any, Any]]  # (weakref to optimizer, hook handle)
    _submitter: Optional[concurrent.futures.ThreadPoolExecutor]
    _lock: threading.Lock
    _replicator: Optional[Any]  # shmckpt.replicas.Replicator with replicas > 0
    _checker: Optional[Any]  # shmckpt._divergence.ReplicaCheck with check_replicas
    _scratch: Optional[str]
    _layout: Optional[Any]  # shmckpt._layout.Layout of the last save, reused when it matches

    def _forget(self, h: SaveHandle) -> None:
        with self._lock:
            self._pending = [p for p in self._pending if p is not h]

    def _wait_all(self, wait: Callable[[SaveHandle], Any]) -> None:
        """``wait`` on every save in flight; a failed save raises its error once (and is
        then forgotten), a Ctrl-C leaves the saves pending."""
        for h in list(self._pending):
            try:
                wait(h)
            except KeyboardInterrupt:
                raise
            except BaseException:
                self._forget(h)
                raise
        self._reap()

    def _reap(self) -> None:
        with self._lock:
            keep = []
            for h in self._pending:
                h._poll()
                if not (h.staged() and h.done()):
                    keep.append(h)
            self._pending = keep
