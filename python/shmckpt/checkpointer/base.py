"""What the parts of ``Checkpointer`` share: step arguments, the rank and world size from
``torch.distributed``, and :class:`Shared`, the state its collaborators (``Saver``,
``Guard``, ``Loader``) are given by its constructor (in ``core.py``)."""

from __future__ import annotations

import json
import operator
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from ..errors import NotFound
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


class Shared:
    """What the collaborators of one :class:`~shmckpt.Checkpointer` share (its saver,
    guard and loader, its replicator and the bucket helpers of :mod:`shmckpt.remote`):
    the rank's identity, its engine, and the bookkeeping of the saves in flight. Given to
    each explicitly, so that none reaches into the checkpointer (it satisfies
    :class:`shmckpt._host.CheckpointerLike`)."""

    def __init__(self, root: str, rank: int, world_size: int, remote: Optional[str], engine: Any) -> None:
        self.root = root
        self.rank = rank
        self.world_size = world_size
        #: The bucket every committed save is mirrored to (``s3://bucket/prefix``), or None.
        self.remote = remote
        #: The ``shmckpt._shmckpt.Engine`` (replaced only by tests, through the checkpointer).
        self.engine: Any = engine
        self.pending: List[SaveHandle] = []
        self.lock = threading.Lock()
        #: ``shmckpt.replicas.Replicator`` with ``replicas > 0``, else None.
        self.replicator: Optional[Any] = None
        #: ``shmckpt._divergence.ReplicaCheck`` with ``check_replicas``, else None.
        self.checker: Optional[Any] = None

    def forget(self, h: SaveHandle) -> None:
        with self.lock:
            self.pending = [p for p in self.pending if p is not h]

    def track(self, h: SaveHandle) -> None:
        """A save in flight: waited for by ``wait``, ``flush`` and ``close``; replicated
        once committed (with replicas)."""
        with self.lock:
            self.pending.append(h)
        if self.replicator is not None:
            self.replicator.enqueue(h)

    def wait_all(self, wait: Callable[[SaveHandle], Any]) -> None:
        """``wait`` on every save in flight; a failed save raises its error once (and is
        then forgotten), a Ctrl-C leaves the saves pending."""
        for h in list(self.pending):
            try:
                wait(h)
            except KeyboardInterrupt:
                raise
            except BaseException:
                self.forget(h)
                raise
        self.reap()

    def reap(self) -> None:
        with self.lock:
            keep = []
            for h in self.pending:
                h._poll()
                if not (h.staged() and h.done()) or h._unreported():
                    keep.append(h)
            self.pending = keep

    def resolve(self, step: StepArg) -> int:
        """A step argument as a committed step: ``"latest"`` the newest of memory or disk
        (a memory-only step when newest), as a local load of it."""
        sel = _step_sel(step)
        if sel is not None:
            return sel
        latest = self.engine.latest_in("local")
        if latest is None:
            raise NotFound(f"no committed checkpoint (latest) in {self.root}", path=self.root)
        return int(latest)

    def manifest(self, step: StepArg = "latest") -> Dict[str, Any]:
        """The manifest of a committed checkpoint (files, tensors, offsets, CRC-32C)."""
        return json.loads(self.engine.manifest(self.resolve(step)))

    def rank_entry(self, step: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """The manifest of committed ``step`` and this rank's file entry in it."""
        m = json.loads(self.engine.manifest(step))
        for f in m["files"]:
            if f["rank"] == self.rank:
                return m, f
        raise NotFound(
            f"checkpoint step {step} in {self.root} has no file of rank {self.rank}", path=self.root, step=step
        )
