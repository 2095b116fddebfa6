"""``SaveHandle`` (a save in flight) and ``LoadResult`` (what ``load_into`` did)."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import CommitRefused, ConfigError, ReplicaDivergence, ShmckptError


class SaveHandle:
    """A save in flight (returned by :meth:`Checkpointer.save`).

    ``wait_staged()``: every byte is copied out of the caller's tensors (they may then
    change). ``wait()``: the checkpoint is durable and committed; returns the save report
    (a dict of sizes and timings in seconds). A memory-only save (``disk_every``) is done
    once staged: its report says ``memory_only: True``, ``tiers: ["memory"]``, ``dir:
    None``; it is not durable (it survives a crash of the process, not of the machine).
    ``done()``: committed or failed. All waits
    release the GIL and are interruptible (Ctrl-C raises ``KeyboardInterrupt``; the save
    itself carries on and can be waited for again).
    """

    def __init__(self, step: int, keep: List[Any]):
        self.step = step
        self._keep: Optional[List[Any]] = keep  # torch objects read by the engine
        self._future: Optional[concurrent.futures.Future] = None
        self._rust: Optional[Any] = None
        self._lock = threading.Lock()
        self._replicator: Optional[Any] = None  # shmckpt.replicas.Replicator with replicas > 0
        self._metadata: Dict[str, str] = {}
        # CUDA devices whose copies the engine queues itself (guard: stream-ordered wait).
        self._devices: List[int] = []
        self._snapshot = False  # save(..., snapshot="device"): the guard takes a snapshot
        # A save captured on the submitting thread (its future gives the engine's handle):
        # the guard waits for the capture, then on the device as for a save captured at
        # the call; a failed capture is reported by the next save or wait, not the guard.
        self._deferred = False
        # A deferred save started speculatively at its call (``Saver._speculate``): what
        # checks it and gives its future a result (run once, by the first of the guard's
        # wait, a wait, ``done`` or the next save).
        self._settle: Optional[Any] = None
        self._settle_lock = threading.Lock()
        # A speculative start's future of the engine's provisional handle (None when it
        # started nothing): with a snapshot, the guard asks it for the snapshot before the
        # check, so the device copies run while the check does (``_snapshot.request_early``).
        self._started: Optional[concurrent.futures.Future] = None
        #: Device bytes of the save's snapshot (``snapshot="device"``; 0 when none was taken).
        self.snapshot_bytes = 0
        # check_replicas: the checkpointer's divergence check (shmckpt._divergence), whether
        # it decided this save's commit, the divergence it found and a failure of the check.
        self._checker: Optional[Any] = None
        self._checked = False
        self._divergence: Optional[ReplicaDivergence] = None
        self._check_error: Optional[BaseException] = None
        #: Seconds the replica check of this save took once its checksums were known
        #: (``check_replicas``), or None before (and without) it.
        self.replica_check_seconds: Optional[float] = None

    # -- internals ---------------------------------------------------------------------
    def _set_rust(self, h: Any) -> None:
        self._rust = h

    def _settled(self) -> None:
        """Check a speculative save (``_settle``) if not done yet; a second caller waits
        for the first's check."""
        if self._settle is None:
            return
        with self._settle_lock:
            settle, self._settle = self._settle, None
            # (Asked for the snapshot before the check or not at all: a refused start's
            # handle is not kept past it.)
            self._started = None
            if settle is not None:
                settle()

    def _get_rust(self) -> Any:
        if self._rust is not None:
            return self._rust
        self._settled()
        fut = self._future
        assert fut is not None
        while True:
            try:
                self._rust = fut.result(timeout=0.05)
                return self._rust
            except concurrent.futures.TimeoutError:
                continue
            except BaseException:
                # Only a submission that failed (its future done) no longer reads the
                # tensors; a Ctrl-C while it still runs must not drop them.
                if fut.done():
                    self._release()
                raise

    def _unreported(self) -> bool:
        """A deferred save whose capture failed: kept among the saves in flight until the
        next save or wait raises its error."""
        f = self._future
        return self._deferred and f is not None and f.done() and f.exception() is not None

    def _release(self) -> None:
        with self._lock:
            self._keep = None

    def _poll(self) -> None:
        """Drop the references once staged."""
        if self._keep is None:
            return
        if self._rust is None and self._future is not None:
            if not self._future.done():
                return
            if self._future.exception() is not None:
                # Submission failed (its handle raises the error): nothing reads the tensors.
                self._release()
                return
            self._rust = self._future.result()
        if self._rust is not None and self._rust.is_staged():
            self._release()

    # -- public ------------------------------------------------------------------------
    def staged(self) -> bool:
        """True once every byte is staged (or the save failed)."""
        self._poll()
        return self._keep is None

    def done(self) -> bool:
        """True once the checkpoint is committed or the save failed."""
        self._settled()
        if self._rust is None and self._future is not None:
            if not self._future.done():
                return False
            if self._future.exception() is not None:
                return True
            self._rust = self._future.result()
        rust = self._rust
        assert rust is not None  # a handle gets its Rust handle or a future when made
        done = bool(rust.is_done())
        if done:
            self._poll()
        return done

    def wait_staged(self) -> Optional[Dict[str, Any]]:
        """Block until every byte is staged; returns the staging report."""
        h = self._get_rust()
        try:
            rep = h.wait_staged()
        except KeyboardInterrupt:
            raise
        except BaseException:
            self._release()
            raise
        self._release()
        return rep

    def wait(self) -> Dict[str, Any]:
        """Block until the checkpoint is durable and committed; returns the report. A
        memory-only save (``disk_every``) returns once staged, its report's ``memory_only``
        true and ``tiers`` ``["memory"]``: not durable.

        With ``check_replicas``: the replica check of this save (and of the earlier saves
        not checked yet) runs here, a collective over the group;
        :class:`~shmckpt.errors.ReplicaDivergence` when the replicas diverge and the step
        was not committed (with ``on_divergence="warn"`` the report's
        ``replica_divergence`` holds it)."""
        if self._checker is not None and not self._checked:
            self._checker.check_through(self)
        h = self._get_rust()
        if self._snapshot:
            # Known once staged: the guard's hook returns before the snapshot is taken
            # (``Tuning.stream_latches``). A staging error is raised by ``wait`` below.
            try:
                h.wait_staged()
            except ShmckptError:
                pass
            self.snapshot_bytes = max(self.snapshot_bytes, int(h.snapshot_bytes()))
        try:
            rep = h.wait()
        except CommitRefused as e:
            if self._check_error is not None:
                raise self._check_error from e
            if self._divergence is not None:
                raise self._divergence from None
            raise
        except KeyboardInterrupt:
            raise
        finally:
            self._poll()
        self._release()
        out = dict(rep, snapshot_bytes=self.snapshot_bytes)
        if self._checker is not None:
            out["replica_check"] = self.replica_check_seconds
            out["replica_divergence"] = self._divergence
        return out

    def wait_replicated(self) -> Dict[str, Any]:
        """Wait until the step, replicated in the background once committed, is held and
        CRC-checked by ``replicas`` ranks on other machines for every rank; returns the
        replication report (``docs/replicas.md``).
        :class:`~shmckpt.errors.ReplicationError` when it is not."""
        if self._replicator is None:
            raise ConfigError("wait_replicated() needs a Checkpointer made with replicas > 0")
        return self._replicator.wait_replicated(self)

    def wait_remote(self) -> Dict[str, Any]:
        """Block until the step is committed in the bucket (``remote=...``); returns the
        remote report (``bytes``, ``upload`` and ``remote_durable`` seconds,
        ``committed_here``, ``retired``, ``read_from_file``: bytes read from the local
        file rather than the staging memory, ``retried``: ``(step, None)`` when this save
        uploaded an earlier failed step again, ``(step, why)`` when it did not, else
        ``None``). Raises ``RemoteFailed`` (nothing of the step is visible in the bucket;
        the next save retries it) or ``RemoteSkipped`` (the uploader was behind)."""
        return self._get_rust().wait_remote()

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, staged={self.staged()}, done={self.done()})"


@dataclass
class LoadResult:
    """What :meth:`Checkpointer.load_into` did."""

    step: int
    #: Destination keys (flat names) the checkpoint has no tensor for.
    missing_keys: List[str] = field(default_factory=list)
    #: Checkpoint tensors no destination was given for (read and checked, not stored).
    unexpected_keys: List[str] = field(default_factory=list)
