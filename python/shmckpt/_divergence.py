"""Replica divergence check (``Checkpointer(check_replicas=group)``): before a save's
commit becomes visible, the ranks of a data-parallel group compare the CRC-32Cs of the
tensors they all hold (``docs/guarantees.md``, "Replica divergence").

Each save is started with its commit held by the engine (``confirm=True``); once its file
is durable, its tensors' CRC-32Cs are known (computed as the chunks drained), and this
module gathers them over the group (one ``all_gather_object`` of ``(name, dtype, shape,
crc32c)`` per tensor), asks the engine which replicated tensors differ
(``replica_divergence``, the Rust ``shmckpt::divergence::compare``) and confirms or refuses
the commit. Every rank of the group gathers the same digests and so reaches the same
decision; a callback's answer is agreed on by a second gather. The checks run on the
caller's thread, in save order, at ``handle.wait()``, ``Checkpointer.wait()``,
``flush()``, ``close()`` and at the start of the next ``save()``: every rank of the group
must make those calls for the same steps (as with any collective).
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

from . import _shmckpt
from .errors import ConfigError, ReplicaDivergence

if TYPE_CHECKING:  # pragma: no cover
    from ._handle import SaveHandle

OnDivergence = Union[str, Callable[[ReplicaDivergence], bool]]


class ReplicaDivergenceWarning(UserWarning):
    """Replicas diverged and the step was committed anyway (``on_divergence="warn"``)."""


class ReplicaCheck:
    """The divergence check of one :class:`~shmckpt.Checkpointer`."""

    def __init__(self, rank: int, group: Any, on_divergence: OnDivergence):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("check_replicas needs torch.distributed initialized")
        if not (on_divergence in ("raise", "warn") or callable(on_divergence)):
            raise ConfigError(f'on_divergence must be "raise", "warn" or a callable, not {on_divergence!r}')
        self._dist = dist
        self.rank = rank
        self.group = group
        self.on_divergence = on_divergence
        self._queue: List["SaveHandle"] = []
        self._lock = threading.RLock()  # one check at a time, in save order
        #: Seconds the last check took once the save's checksums were known (the gather,
        #: the comparison and the decision), or None.
        self.last_seconds: Optional[float] = None

    def add(self, handle: "SaveHandle") -> None:
        with self._lock:
            self._queue.append(handle)

    def check_through(self, handle: Optional["SaveHandle"] = None) -> None:
        """Check the queued saves in order, up to ``handle`` (every one when ``None``; none
        when ``handle`` is not queued: it was checked already)."""
        with self._lock:
            if handle is not None and not any(h is handle for h in self._queue):
                return
            while self._queue:
                h = self._queue[0]
                try:
                    self._check(h)
                finally:
                    # Decided (or refused because the check failed): never checked again.
                    if h._checked:
                        self._queue.pop(0)
                if h is handle:
                    return

    def refuse_all(self, why: str) -> None:
        """Refuse the commit of every save not checked yet (the checkpointer is closing
        after a failed check: no collective can decide them)."""
        with self._lock:
            for h in self._queue:
                rust = h._rust
                if rust is not None:
                    rust.confirm_commit(why)
                h._checked = True
            self._queue.clear()

    # -- one save ----------------------------------------------------------------------
    @staticmethod
    def wait_checksums(rust: Any) -> List[Any]:
        """The ``(name, dtype, shape, crc32c)`` of each tensor of the save ``rust`` (an
        engine save handle started with ``confirm=True``) once its file is durable; raises
        the save's error when it failed first."""
        nap = 0.0002
        while True:
            sums = rust.checksums()
            if sums is not None:
                return list(sums)
            time.sleep(nap)
            nap = min(nap * 2, 0.005)

    def _digests(self, handle: "SaveHandle") -> Tuple[Optional[List[Any]], str]:
        """This rank's digests of ``handle``'s save once known, or None and why not."""
        if handle._rust is None and handle._future is None:
            return None, "the save was refused when it started"
        try:
            rust = handle._get_rust()
            return self.wait_checksums(rust), ""
        except Exception as e:  # the save never started, or failed before it was durable
            return None, f"{type(e).__name__}: {e}"

    def _check(self, handle: "SaveHandle") -> None:
        digests, why = self._digests(handle)  # Ctrl-C here: still queued, checked later
        t0 = time.perf_counter()
        try:
            handle._divergence = self.check_step(handle.step, digests, why, handle._rust)
        except BaseException as e:
            handle._check_error = e
            raise
        finally:
            handle._checked = True
            self.last_seconds = handle.replica_check_seconds = time.perf_counter() - t0

    def check_step(
        self, step: int, digests: Optional[List[Any]], why: str, rust: Any, what: Optional[str] = None
    ) -> Optional[ReplicaDivergence]:
        """The check of one save, on every rank of the group: gather this rank's
        ``digests`` (None: its save failed, ``why``), compare, decide, and confirm or refuse
        the commit of ``rust`` (the engine's save handle, held by ``confirm=True``).
        Returns the divergence found (``committed`` says whether the step was committed
        anyway) or None; raises the group's error (the commit refused) when the check
        itself failed. ``what`` names the checkpoint in messages (default ``step N``)."""
        try:
            n = self._dist.get_world_size(self.group)
            got: List[Any] = [None] * n
            self._dist.all_gather_object(got, (self.rank, digests, why), group=self.group)
            ranks = [int(r) for r, _, _ in got]
            failed = [(r, w) for r, d, w in got if d is None]
            if failed:
                reason = "; ".join(f"rank {r}'s save failed ({w})" for r, w in failed)
                if rust is not None:
                    rust.confirm_commit(f"replica check of {what or f'step {step}'}: {reason}")
                return None
            found = _shmckpt.replica_divergence([d for _, d, _ in got])
            if not found:
                assert rust is not None
                rust.confirm_commit(None)
                return None
            divs = [
                (name, [ranks[i] for i in odd], {ranks[i]: int(c) for i, c in enumerate(crcs)})
                for name, odd, crcs, _ in found
            ]
            commit = self._decide(step, divs, what)
            err = ReplicaDivergence(_message(step, divs, commit, what), step, divs, committed=commit)
            assert rust is not None
            if commit:
                if self.on_divergence == "warn":
                    warnings.warn(str(err), ReplicaDivergenceWarning, stacklevel=5)
                rust.confirm_commit(None)
            else:
                rust.confirm_commit(str(err))
            return err
        except BaseException as e:
            # The group failed (a rank died or timed out) or the decision raised: the step
            # is not committed (its commit is refused; the caller gets this error).
            if rust is not None:
                rust.confirm_commit(f"replica check of {what or f'step {step}'} failed: {type(e).__name__}: {e}")
            raise

    def _decide(self, step: int, divs: List[Tuple[str, List[int], Dict[int, int]]], what: Optional[str] = None) -> bool:
        """Whether to commit despite ``divs``: the same answer on every rank of the group."""
        if self.on_divergence == "raise":
            return False
        if self.on_divergence == "warn":
            return True
        cb = self.on_divergence
        assert callable(cb)
        raised: Optional[Exception] = None
        try:
            mine = bool(cb(ReplicaDivergence(_message(step, divs, False, what), step, divs)))
        except Exception as e:  # counts as "do not commit"; raised once every rank voted
            mine, raised = False, e
        n = self._dist.get_world_size(self.group)
        votes: List[Any] = [None] * n
        self._dist.all_gather_object(votes, mine, group=self.group)
        if raised is not None:
            raise raised
        return all(bool(v) for v in votes)


def _message(
    step: int, divs: List[Tuple[str, List[int], Dict[int, int]]], committed: bool, what: Optional[str] = None
) -> str:
    parts = []
    for name, odd, crcs in divs[:8]:
        shown = ", ".join(f"rank {r}: {c:#010x}" for r, c in sorted(crcs.items()))
        parts.append(f"{name!r} differs on rank(s) {odd} ({shown})")
    more = f" and {len(divs) - 8} more tensors" if len(divs) > 8 else ""
    done = "committed anyway" if committed else "not committed"
    return f"replicas diverge in {what or f'step {step}'} ({done}): " + "; ".join(parts) + more
