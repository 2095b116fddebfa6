"""``Checkpointer``: save and restore nested PyTorch training state through the engine."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import gc
import json
import operator
import os
import stat
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _shmckpt
from . import _snapshot
from . import _state
from . import remote as _remote
from .errors import ConfigError, CorruptError, DestinationError, NotFound, UnsafePath

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]

__all__ = ["Checkpointer", "SaveHandle", "LoadResult"]

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
    if step is None or step == "latest":
        return None
    if isinstance(step, (bool, np.bool_)):
        raise TypeError("step must be an int or 'latest'")
    return operator.index(step)


class SaveHandle:
    """A save in flight (returned by :meth:`Checkpointer.save`).

    ``wait_staged()``: every byte is copied out of the caller's tensors (they may then
    change). ``wait()``: the checkpoint is durable and committed; returns the save report
    (a dict of sizes and timings in seconds). ``done()``: committed or failed. All waits
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
        #: Device bytes of the save's snapshot (``snapshot="device"``; 0 when none was taken).
        self.snapshot_bytes = 0

    # -- internals ---------------------------------------------------------------------
    def _set_rust(self, h: Any) -> None:
        self._rust = h

    def _get_rust(self) -> Any:
        if self._rust is not None:
            return self._rust
        fut = self._future
        assert fut is not None
        while True:
            try:
                self._rust = fut.result(timeout=0.05)
                return self._rust
            except concurrent.futures.TimeoutError:
                continue
            except BaseException:
                # Submission failed: nothing reads the tensors any more.
                self._release()
                raise

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
            try:
                self._rust = self._future.result()
            except BaseException:
                self._release()
                return
        if self._rust is not None and self._rust.is_staged():
            self._release()

    # -- public ------------------------------------------------------------------------
    def staged(self) -> bool:
        """True once every byte is staged (or the save failed)."""
        self._poll()
        return self._keep is None

    def done(self) -> bool:
        """True once the checkpoint is committed or the save failed."""
        if self._rust is None and self._future is not None:
            if not self._future.done():
                return False
            if self._future.exception() is not None:
                return True
            self._rust = self._future.result()
        done = bool(self._rust.is_done())
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
        """Block until the checkpoint is durable and committed; returns the report."""
        h = self._get_rust()
        if self._snapshot:
            self.snapshot_bytes = max(self.snapshot_bytes, int(h.snapshot_bytes()))
        try:
            rep = h.wait()
        except KeyboardInterrupt:
            raise
        finally:
            self._poll()
        self._release()
        return dict(rep, snapshot_bytes=self.snapshot_bytes)

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


def _canonical(name: str) -> str:
    """A flat name without the ``_orig_mod.`` components ``torch.compile`` adds."""
    parts = [p for p in name.split(".") if p != "_orig_mod"]
    return ".".join(parts)


@contextlib.contextmanager
def _gc_paused() -> Any:
    """No cyclic garbage collection inside: flattening a large state allocates a few
    objects per tensor, all kept, which otherwise triggers repeated collections (of the
    whole heap, tensors included) costing more than the flattening itself."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _storage_key(t: Any) -> Tuple[str, int]:
    """Identifies the memory a tensor (or a DTensor's local shard) lives in."""
    if _state._is_dtensor(t):
        t = t.to_local()
    return (str(t.device), t.untyped_storage().data_ptr())


def _host_tuple(name: str, st_dtype: str, t: Any) -> Tuple[str, str, List[int], int, int, int]:
    """The engine tuple of a contiguous CPU tensor or array (the caller keeps ``t``)."""
    if isinstance(t, np.ndarray):
        nbytes = int(t.nbytes)
        ptr = int(t.ctypes.data) if nbytes else 0
        return (name, st_dtype, list(t.shape), ptr, nbytes, -1)
    nbytes = t.numel() * t.element_size()
    ptr = int(t.data_ptr()) if nbytes else 0
    return (name, st_dtype, list(t.shape), ptr, nbytes, -1)


def _cuda_span_copy(t: Any) -> Tuple[Any, Any]:
    """Queue a copy of a CUDA tensor's bytes into pinned host memory on the current stream,
    allocating no device memory. Returns (pinned, finish): ``finish()`` (after the stream
    has reached the copy) gives the contiguous host tensor of ``t``'s values. A conjugate or
    negative view's memory is copied as it is and its bits are applied on the host."""
    if _state.is_lazy(t):
        raw, apply = _state.raw_view(t)
        pinned, finish = _cuda_span_copy(raw)
        return pinned, (lambda: apply(finish()))
    if t.is_contiguous():
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if t.numel():
            h.copy_(t, non_blocking=True)
        return h, (lambda: h)
    # Copy the whole storage span the view covers (contiguous, so no device temporary),
    # then gather on the host.
    base, gather = _span(t)
    h = torch.empty(base.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(base, non_blocking=True)
    return h, (lambda: gather(h))


def _span(t: Any) -> Tuple[Any, Any]:
    """A contiguous 1-D view of the storage range a (non-empty) strided tensor covers, and
    the function that rebuilds the tensor's logical contents from a copy of it."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    base = t.as_strided((span,), (1,), t.storage_offset())
    shape, stride = tuple(t.shape), tuple(t.stride())
    return base, (lambda copy: copy.as_strided(shape, stride, 0).contiguous())


def _open_untrusted(path: str) -> Any:
    """Open a file of a checkpoint for reading as the engine's reader does: no link
    followed, never blocked by a FIFO, regular files only (``UnsafePath`` otherwise)."""
    f = open(path, "rb", opener=lambda p, fl: os.open(p, fl | os.O_NOFOLLOW | os.O_NONBLOCK))
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise UnsafePath(f"{path}: not a regular file; refusing to read it")
    return f


_OPEN: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit, finish the saves in flight and remove the staging segments."""
    for ck in list(_OPEN):
        try:
            ck.close()
        except BaseException:  # pragma: no cover - best effort at exit
            pass


class Checkpointer:
    """Checkpoints of one rank under ``root``.

    ``root`` is a writable directory (shared by all ranks), created with its missing parents
    when it does not exist (``RootCreateFailed`` says why when it cannot be). The rank and
    world size come from ``torch.distributed`` when it is initialized, else 0 of 1 (or
    give them; with ``torch.distributed``, every rank must then build its checkpointer, as
    the constructor ends with a barrier). Other keyword arguments are the engine settings
    (``keep_last``: retention, default keep all; see ``docs/python.md``).

    ``staging_capacity``: bytes of shared-memory staging, the largest checkpoint file this
    rank can write. Not given (``None``), it sizes itself: the arena starts at 64 MiB and the
    first save that needs more reopens the engine with an arena of that save's size plus
    1/16 (after the saves in flight are committed), bounded by the free space of
    ``/dev/shm`` (``ShmTooSmall``, naming ``staging_capacity``, when that cannot hold the
    save). Give it to reserve the arena here instead of in the first save.

    ``keep_in_memory=True`` turns on flash restore: the staging arena (as large as
    ``staging_capacity``, in ``/dev/shm``) outlives the process, a crash included, holding
    the last committed checkpoint; the next ``Checkpointer`` of the same root and rank loads
    that step from memory when it is still the newest on disk and every CRC-32C matches the
    committed manifest, else from disk (the reason is logged). :attr:`last_load_source`
    says which path served a load. ``shmckpt shm list`` / ``shmckpt shm rm`` manage kept
    arenas. Off by default: nothing is kept.

    ``remote="s3://bucket/prefix"`` mirrors every committed save to a bucket (credentials
    and endpoint from the AWS environment variables): ``handle.wait_remote()`` waits for
    the step to be committed there, ``remote_keep_last`` is the bucket's retention,
    ``remote_max_pending`` (default 2) the saves that may wait for the uploader before the
    oldest waiting one is skipped, ``list(remote=True)`` lists the bucket, and loads fall
    back to it. A root of ``s3://...`` keeps no checkpoint on disk. See ``docs/remote.md``.

    ``replicas=k`` (with ``node``, ``replica_group``, ``replica_bandwidth``: bytes per
    second each rank sends replicas at, at most, default 1 GiB/s, ``None`` unbounded;
    ``replica_timeout``: seconds a replication step waits for a peer, default 300) keeps
    each rank's committed file in the memory of ``k`` ranks on other machines;
    ``node_local_root=True`` (with ``replicas > 0``): ``root`` is this machine's own disk,
    not shared, and every step commits through the process group (in the replication
    thread: ``wait_replicated()``, not ``wait()``, says it is committed); see
    ``docs/replicas.md``.
    """

    def __init__(
        self,
        root: Union[str, os.PathLike],
        *,
        keep_last: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        staging_capacity: Optional[int] = None,
        chunk_size: Optional[int] = None,
        writer_threads: Optional[int] = None,
        queue_depth: Optional[int] = None,
        copy_threads: Optional[int] = None,
        direct_io: Optional[bool] = None,
        max_inflight_saves: Optional[int] = None,
        recover_on_open: Optional[bool] = None,
        shm_name: Optional[str] = None,
        keep_in_memory: bool = False,
        replicas: int = 0,
        node: Optional[str] = None,
        replica_group: Any = None,
        replica_bandwidth: Optional[float] = float(1 << 30),
        replica_timeout: float = 300.0,
        node_local_root: bool = False,
        remote: Optional[str] = None,
        remote_keep_last: Optional[int] = None,
        remote_max_pending: Optional[int] = None,
    ):
        r, w = _dist_rank_world()
        self.rank = r if rank is None else int(rank)
        self.world_size = w if world_size is None else int(world_size)
        self.root = os.fspath(root)
        #: The bucket every committed save is mirrored to (``s3://bucket/prefix``), or None.
        self.remote = remote
        # Remote only (`Checkpointer("s3://...")`): a private scratch directory as the
        # engine's root, emptied after each upload started (see shmckpt.remote).
        self._scratch, engine_root, remote_only = _remote.scratch_for(self.root, remote)
        if remote_only:
            self.remote = self.root
        # Ranks of one run share a session id, so that a rank's upload of an earlier run
        # of the same step number never counts toward a commit in the bucket.
        session = None
        if self.remote is not None and self.world_size > 1 and rank is None and world_size is None:
            session = _remote.shared_session()
        try:
            self._engine = _shmckpt.Engine(
                engine_root,
                rank=self.rank,
                world_size=self.world_size,
                staging_capacity=staging_capacity,
                chunk_size=chunk_size,
                writer_threads=writer_threads,
                queue_depth=queue_depth,
                copy_threads=copy_threads,
                direct_io=direct_io,
                keep_last=keep_last,
                shm_name=shm_name,
                max_inflight_saves=max_inflight_saves,
                recover_on_open=recover_on_open,
                keep_in_memory=bool(keep_in_memory),
                create_root=True,
                remote=self.remote,
                remote_keep_last=remote_keep_last,
                remote_max_pending=remote_max_pending,
                remote_only=remote_only,
                remote_session=session,
            )
        except BaseException:
            if self._scratch is not None:
                _remote.remove_scratch(self._scratch)
            raise
        if rank is None and world_size is None and self.world_size > 1:
            _dist_barrier()
        self._pending: List[SaveHandle] = []
        self._guards: List[Tuple[Any, Any]] = []  # (weakref to optimizer, hook handle)
        self._submitter: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._replicator: Optional[Any] = None
        if replicas or node_local_root:
            from .replicas import Replicator

            try:
                self._replicator = Replicator(
                    self,
                    replicas,
                    node,
                    replica_group,
                    bandwidth=replica_bandwidth,
                    timeout=replica_timeout,
                    node_local=node_local_root,
                )
            except BaseException:
                self._engine.close()
                raise
        _OPEN.add(self)

    @property
    def last_load_source(self) -> Optional[Tuple[str, Any]]:
        """Which path served the last :meth:`load` (or device :meth:`load_into`): ``("disk", reason)``
        or ``("memory", problem)``; ``reason`` says why shared memory could not serve it when
        ``keep_in_memory`` is on (else ``None``); ``problem`` is ``None`` unless the check of
        the checkpoint file on disk (its size and header, against the kept image) failed: the
        load's bytes are right, but a load from disk would fail (``shmckpt verify`` checks
        every byte). ``None`` before the first load. With ``replicas > 0``: ``("peer", rank)``
        when this rank's file was restored from that rank's replica for the load."""
        src = self._engine.last_load_source()
        if self._replicator is not None:
            return self._replicator.source(src)
        return src

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the saves in flight, then release the staging memory. Idempotent (also
        done at interpreter exit for checkpointers still open).

        Safe to call while another thread uses this checkpointer: the engine's ``close``
        returns only once every save it started is committed or failed (it waits for a
        call in progress on another thread, and a second ``close`` waits for the first),
        so the tensors kept for non-blocking saves are dropped only when nothing reads
        them any more. Calls that begin after it raise ``ShutdownError``."""
        _OPEN.discard(self)
        if self._replicator is not None:
            self._replicator.close()  # the queued replications finish first
        for h in list(self._pending):
            try:
                h._get_rust()
            except Exception:
                pass  # a submission that failed: its handle reports the error
        if self._submitter is not None:
            self._submitter.shutdown(wait=True)
            self._submitter = None
        for _, hook in self._guards:
            hook.remove()
        self._guards.clear()
        self._engine.close()
        with self._lock:
            pending, self._pending = self._pending, []
        for h in pending:
            h._release()
        if self._scratch is not None:
            _remote.remove_scratch(self._scratch)
            self._scratch = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def shm_name(self) -> str:
        """Name of this engine's staging segment in ``/dev/shm``."""
        return self._engine.describe()[0]

    @property
    def staging_capacity(self) -> int:
        """Largest checkpoint file (bytes) a save can stage."""
        return self._engine.describe()[1]

    # -- guard -------------------------------------------------------------------------
    def guard(self, optimizer: Any) -> None:
        """Make ``optimizer.step()`` first wait until every save of this checkpointer has
        copied its bytes. For saves of CUDA tensors the wait is on the device: the hook
        returns once the engine has queued its copies, and the current stream of each
        device waits for them, so the optimizer's kernels run after the copies while the
        trainer's thread goes on; other saves are waited for on the host (``wait_staged``).

        With a guard, ``save(..., blocking=False)`` copies the optimizer's parameters and
        state in the background while the trainer runs its next forward and backward; every
        other tensor of the state (buffers such as BatchNorm running statistics, tensors of
        unguarded optimizers, numpy arrays) is captured at the call. Parameters and state of
        a guarded optimizer must not be changed other than by its ``step()`` (or after the
        handle's ``wait_staged()``).
        """
        ref = weakref.ref(optimizer)
        me = weakref.ref(self)

        def pre_hook(opt: Any, args: Any, kwargs: Any) -> None:
            ck = me()
            if ck is not None:
                ck._guard_wait()

        hook = optimizer.register_step_pre_hook(pre_hook)
        self._guards.append((ref, hook))

    def unguard(self, optimizer: Any) -> None:
        """Remove the guard of ``optimizer``."""
        keep = []
        for ref, hook in self._guards:
            if ref() is optimizer:
                hook.remove()
            else:
                keep.append((ref, hook))
        self._guards = keep

    def _guarded_storages(self) -> set:
        out = set()
        for ref, _ in self._guards:
            opt = ref()
            if opt is None:
                continue
            for g in opt.param_groups:
                for p in g["params"]:
                    out.add(_storage_key(p))
            for st in opt.state.values():
                if isinstance(st, Mapping):
                    for v in st.values():
                        if isinstance(v, torch.Tensor):
                            out.add(_storage_key(v))
        return out

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

    def wait_staged(self) -> None:
        """Wait until every save in flight has copied its bytes. A failed save raises its
        error here once (and is then forgotten)."""
        self._wait_all(SaveHandle.wait_staged)

    def _guard_wait(self) -> None:
        """The guard's wait before an optimizer step. A save whose bytes the engine copies
        itself from CUDA tensors is waited for on the device: once its host bytes are copied
        and its device copies queued (normally milliseconds after the call), the current
        stream of each of its devices waits for those copies (``cuStreamWaitEvent``), and
        the trainer's thread goes on queueing the optimizer step and the next forward. Other
        saves are waited for on the host (``wait_staged``)."""

        def wait(h: SaveHandle) -> Any:
            if not h._devices or h._future is not None or h._keep is None:
                return h.wait_staged()
            streams = [(d, torch.cuda.current_stream(d).cuda_stream) for d in h._devices]
            n = _snapshot.hold(h._get_rust(), h._snapshot, streams)
            h.snapshot_bytes = max(h.snapshot_bytes, n)
            h._poll()
            return None

        self._wait_all(wait)

    def wait(self) -> None:
        """Wait until every save in flight is committed (raises the first error, once)."""
        self._wait_all(SaveHandle.wait)

    def _reap(self) -> None:
        with self._lock:
            keep = []
            for h in self._pending:
                h._poll()
                if not (h.staged() and h.done()):
                    keep.append(h)
            self._pending = keep

    # -- save --------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        blocking: bool = True,
        metadata: Optional[Mapping[str, str]] = None,
        snapshot: Optional[str] = None,
    ) -> SaveHandle:
        """Save ``state`` (nested dict/list/tuple of tensors, arrays and plain values) as
        checkpoint ``step``.

        ``blocking=True`` returns once every byte is staged (the caller may then change its
        tensors); ``blocking=False`` returns at once (see :meth:`guard`). The checkpoint is
        committed in the background; ``handle.wait()`` waits for it. Unsupported values
        raise :class:`~shmckpt.errors.UnsupportedValue` (a ``TypeError``) naming their key
        path before anything is written. Values are saved, never bytes that read otherwise:
        big-endian arrays are stored little-endian, conjugate and negative views resolved.
        ``step`` is an int (never a bool).

        ``snapshot="device"`` (with ``blocking=False`` and :meth:`guard`): what is still
        being copied when the optimizer step starts is snapshotted device-to-device into a
        transient buffer outside torch's allocator, freed once copied
        (``handle.snapshot_bytes``; docs/python.md). The default allocates no device memory.
        """
        step = _step_int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        snap = _snapshot.device_mode(snapshot, blocking, bool(self._guards))
        meta: Dict[str, str] = {}
        for k, v in (metadata or {}).items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"metadata must map str to str; got {k!r}: {type(v).__name__}")
            meta[k] = v
        # No cyclic GC while the per-tensor objects are built: the flattened tree is
        # freed (by reference counting) before collections are allowed again.
        with _gc_paused():
            flat = _state.flatten(state)
            if _state.STATE_KEY in meta:
                raise ValueError(f"metadata key {_state.STATE_KEY!r} is reserved")
            meta[_state.STATE_KEY] = _state.encode(flat)
            self._reap()

            guarded = self._guarded_storages() if (not blocking and self._guards) else set()
            # A non-blocking save with no guard captures CUDA tensors by holding the
            # trainer's streams: the engine queues its copies (into its registered staging)
            # before the call returns, and the streams wait for them on the device, so the
            # next kernels run after them. One device-to-host copy, no pinned host copy, and
            # the trainer's thread waits only while the copies are queued. Only when every
            # CUDA tensor is contiguous (a strided one is captured by a pinned copy of its
            # span, below, which the engine can read only after it finished).
            hold = not blocking and not guarded and all(
                lf.alias_of is not None
                or lf.kind == "ndarray"
                or lf.obj.is_cpu
                or lf.obj.is_contiguous()
                for lf in flat.leaves
            )
            # Engine tuples (name, dtype, shape, address, nbytes, device; device -1 for host
            # memory) and, at the same index, what keeps each one's memory alive.
            entries: List[Tuple[str, str, List[int], int, int, int]] = []
            keep: List[Any] = []
            devices: Dict[int, Any] = {}  # cuda ordinal -> current stream at the call
            finishes: List[Tuple[int, Any]] = []  # (index in entries, finish) for host copies
            add_entry = entries.append
            add_keep = keep.append
            for lf in flat.leaves:
                if lf.alias_of is not None:
                    continue  # an alias: its bytes are those of an earlier leaf
                x = lf.obj
                if lf.kind == "ndarray":
                    # C-contiguous and little-endian (a big-endian array is converted: its
                    # values are stored, never its bytes); captured at the call unless
                    # blocking.
                    a = _state.host_array(x, fresh=not blocking)
                    add_entry(_host_tuple(lf.name, lf.dtype, a))
                    add_keep(a)
                    continue
                if lf.lazy and x.is_cpu:
                    # A conjugate or negative view: its memory is not its values. Store the
                    # values (a new tensor, so nothing of the caller's is read later).
                    x = _state.resolved(x.detach())
                if x.is_cpu:  # (device.type == "cpu", faster)
                    if blocking:
                        # Contiguous: staged from the caller's tensor as it is (no detach
                        # needed to read its address); else a contiguous copy.
                        t = x if x.is_contiguous() else x.detach().contiguous()
                    else:
                        t = x.detach()
                        if not (guarded and _storage_key(t) in guarded):
                            t = t.clone(memory_format=torch.contiguous_format)
                        elif not t.is_contiguous():
                            t = t.contiguous()
                    nbytes = t.numel() * t.element_size()
                    add_entry(
                        (lf.name, lf.dtype, list(t.shape), t.data_ptr() if nbytes else 0, nbytes, -1)
                    )
                    add_keep(t)
                    continue
                t = x.detach()
                dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
                if dev not in devices:
                    devices[dev] = torch.cuda.current_stream(dev)
                is_guarded = bool(guarded) and _storage_key(t) in guarded
                if t.numel() == 0:
                    add_entry((lf.name, lf.dtype, list(t.shape), 0, 0, -1))
                    add_keep(t)
                elif t.is_contiguous() and (blocking or is_guarded or hold) and not lf.lazy:
                    nbytes = t.numel() * t.element_size()
                    add_entry((lf.name, lf.dtype, list(t.shape), int(t.data_ptr()), nbytes, dev))
                    add_keep(t)
                else:
                    with torch.cuda.device(dev):
                        pinned, finish = _cuda_span_copy(t)
                    add_entry((lf.name, lf.dtype, list(t.shape), 0, 0, -1))
                    add_keep([t, pinned])
                    finishes.append((len(entries) - 1, finish))
            del flat

        keep.extend(devices.values())
        handle = SaveHandle(step, keep)
        handle._replicator = self._replicator
        handle._metadata = meta  # node-local roots: the manifest's, committed through the group
        if not finishes:
            handle._devices = sorted(devices)

        def finish_host_copies() -> None:
            for i, fin in finishes:
                e = entries[i]
                h = fin()
                entries[i] = _host_tuple(e[0], e[1], h)
                keep.append(h)

        if blocking:
            if finishes:
                for s in devices.values():
                    s.synchronize()  # this stream only, not the device
                finish_host_copies()
            after = [(d, "stream", s.cuda_stream) for d, s in devices.items()]
            h = self._engine.save(step, entries, meta, after, True)
            handle._set_rust(h)
            handle._release()
        elif hold:
            # The engine records each stream when it starts (it returns only once its copies
            # are queued and the streams wait for them, so nothing was queued after the call).
            after = [(d, "stream", s.cuda_stream) for d, s in devices.items()]
            h = self._engine.save(step, entries, meta, after, False, True)
            handle._set_rust(h)
            with self._lock:
                self._pending.append(handle)
            if self._replicator is not None:
                self._replicator.enqueue(handle)
            return handle
        else:
            # Order the device copies after the work queued at this call: an event recorded
            # now on each device's current stream. (A stream handed to the engine would be
            # recorded by its staging thread, later, after the trainer's next kernels.)
            events = {}
            for d, s in devices.items():
                ev = torch.cuda.Event()
                ev.record(s)
                events[d] = ev
            keep.extend(events.values())
            after = [(d, "event", int(ev.cuda_event)) for d, ev in events.items()]
            if not finishes:
                handle._snapshot = snap and bool(devices)
                h = self._engine.save(step, entries, meta, after, False, False, handle._snapshot)
                handle._set_rust(h)
                with self._lock:
                    self._pending.append(handle)
                if self._replicator is not None:
                    self._replicator.enqueue(handle)
                return handle

            # Host copies of device tensors are in flight on the trainer's streams: wait for
            # the events off the caller's thread, then start the save.
            def submit() -> Any:
                for ev in events.values():
                    ev.synchronize()
                finish_host_copies()
                return self._engine.save(step, entries, meta, after, False)

            if self._submitter is None:
                self._submitter = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="shmckpt-submit"
                )
            handle._future = self._submitter.submit(submit)
        with self._lock:
            self._pending.append(handle)
        if self._replicator is not None:
            self._replicator.enqueue(handle)
        return handle

    # -- queries -----------------------------------------------------------------------
    def latest(self) -> Optional[int]:
        """The newest committed step, or ``None``."""
        return self._engine.latest()

    def list(self, remote: bool = False) -> List[int]:
        """Committed steps, oldest first (``remote=True``: those committed in the bucket)."""
        if remote:
            return list(self._engine.list_remote())
        return [s for s, _ in self._engine.list()]

    def manifest(self, step: StepArg = "latest") -> Dict[str, Any]:
        """The manifest of a committed checkpoint (files, tensors, offsets, CRC-32C)."""
        return json.loads(self._engine.manifest(self._resolve(step)))

    def remove(self, step: int) -> None:
        """Delete committed checkpoint ``step`` (all ranks' files): it leaves the listing at
        once, durably (renamed to a trash name), then its files are deleted. ``NotFound``
        when it is not committed, or when its save is still in flight (wait for that
        handle first). For retention driven by the caller (``keep_last`` does it
        automatically otherwise)."""
        self._engine.remove(operator.index(step))

    def flush(self) -> None:
        """Wait for every save in flight to be committed or to fail."""
        self._engine.flush()
        self._reap()

    def prepare_cuda(
        self, devices: Optional[Sequence[int]] = None, *, background: bool = False
    ) -> Optional[float]:
        """Register the staging memory with CUDA now (otherwise the first device save does
        it). Returns the registration time in seconds when this call did it.

        The registration needs the whole staging arena allocated, which the constructor
        leaves to background threads: this call waits for them first. With
        ``background=True`` it returns at once (``None``) and the registration runs on a
        background thread as soon as the arena is allocated; a device save started before
        then waits for it. :meth:`wait_staging_ready` waits for both.
        """
        if devices is None:
            devices = [torch.cuda.current_device()]
        if background:
            self._engine.prepare_cuda_background(list(devices))
            return None
        return self._engine.prepare_cuda(list(devices))

    def staging_ready(self) -> bool:
        """True once the staging memory is wholly allocated (the constructor allocates it
        in the background) and no background CUDA registration is running: a save then
        pays no one-time cost."""
        return self._engine.staging_ready()

    def wait_staging_ready(self) -> None:
        """Wait until the staging memory is wholly allocated and registered. Raises
        ``ShmTooSmall`` if ``/dev/shm`` filled up before it was."""
        self._engine.wait_staging_ready()

    def _resolve(self, step: StepArg) -> int:
        sel = _step_sel(step)
        if sel is not None:
            return sel
        latest = self._engine.latest()
        if latest is None:
            raise NotFound(f"no committed checkpoint (latest) in {self.root}")
        return latest

    def _rank_entry(self, step: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        m = json.loads(self._engine.manifest(step))
        for f in m["files"]:
            if f["rank"] == self.rank:
                return m, f
        raise NotFound(f"checkpoint step {step} in {self.root} has no file of rank {self.rank}")

    def _skeleton(self, step: int, entry: Dict[str, Any]) -> Optional[Any]:
        d = os.path.join(self.root, f"step-{step}")
        path = os.path.join(d, entry["file"])
        # Read by the engine after the header is checked against the manifest (its tensors
        # and its CRC-32C): a damaged header is an error, never a skeleton read wrongly.
        meta = self._engine.file_metadata(step)
        text = meta.get(_state.STATE_KEY)
        if text is None:
            return None
        try:
            return _state.decode(text)
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise CorruptError(f"{path}: malformed {_state.STATE_KEY} metadata: {e}") from None

    # -- load --------------------------------------------------------------------------
    def load(
        self, step: StepArg = "latest", *, map_location: Any = None, source: Optional[str] = None
    ) -> Any:
        """Load a checkpoint: the nested state as saved (tensors, arrays, plain values).

        ``map_location=None`` or ``"cpu"``: CPU tensors backed by the loaded buffers (no
        copy). ``"cuda:N"``: tensors on that device, copied from the staging memory while
        the file is read (from the bucket: each ranged GET's body through CUDA-registered
        staging buffers, no host copy of the file). Checkpoints not written by this package
        come back as a flat dict of tensors. Every CRC-32C is verified.

        ``source``: ``None`` serves the step from memory (``keep_in_memory``), else the
        local disk, else the bucket (``remote=...``; "latest" means the disk's latest when
        the disk holds any); ``"local"`` never reads the bucket; ``"remote"`` reads only
        the bucket. :attr:`last_load_source` says which served it.
        """
        if self._replicator is not None and source != "remote":
            self._replicator.agree_step(_step_sel(step))  # node-local roots: collective
        s, where = _remote.resolve(self, _step_sel(step), source)
        if self._replicator is not None and where != "remote":
            self._replicator.before_load(s)  # collective: a lost file comes from a peer
        dev = None
        if map_location is not None:
            dev = torch.device(map_location) if torch is not None else None
            if dev is not None and dev.type == "cpu":
                dev = None
            elif dev is not None and dev.type != "cuda":
                raise ValueError(f"map_location {map_location!r}: only cpu and cuda are supported")
        objs: Dict[str, Any] = {}
        if where == "remote" and dev is not None:
            # Bucket -> registered staging buffers -> device (no host copy of the file).
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            objs, tree, entry = _remote.load_to_device(self, s, dev)
        elif where == "remote":
            # Read into host buffers (checked); the skeleton is the rank file's header's.
            _, _, file_meta, tensors = self._engine.load_remote(s)
            tree = _remote.skeleton(self, s, file_meta)
            entry = _remote.entry_of(tensors)
            for name, dtype, shape, buf in tensors:
                objs[name] = (dtype, shape, buf)
        else:
            _, entry = self._rank_entry(s)
            tree = self._skeleton(s, entry)
        if where != "remote" and dev is None:
            got_step, _, _, tensors = self._engine.load(s)
            for name, dtype, shape, buf in tensors:
                objs[name] = (dtype, shape, buf)
        elif where != "remote" and dev is not None:
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            dest = []
            for t in entry["tensors"]:
                tdt = _state.ST_TO_TORCH.get(t["dtype"])
                if tdt is None:
                    raise DestinationError(f"tensor {t['name']!r}: dtype {t['dtype']} has no torch dtype")
                x = torch.empty(t["shape"], dtype=tdt, device=dev)
                objs[t["name"]] = x
                dest.append(x)
            # The memory may come from blocks freed by work still queued on this stream.
            torch.cuda.current_stream(dev).synchronize()
            self._engine.load_into_device(
                s,
                [
                    (n, int(x.data_ptr()), x.numel() * x.element_size(), dev.index)
                    for n, x in objs.items()
                ],
            )

        file_dtype = {t["name"]: t["dtype"] for t in entry["tensors"]}

        def host_tensor(name: str, node: Optional[Dict[str, Any]]) -> Any:
            o = objs[name]
            if node is not None and node.get("t") == "ndarray":
                ndt = np.dtype(str(node.get("dtype")))
                if _state.NUMPY_TO_ST.get(ndt) != file_dtype.get(name):
                    raise ValueError(f"array {name!r}: numpy dtype {ndt} does not match the file")
                if not isinstance(o, tuple):  # loaded to a device: arrays live on the host
                    shape = list(o.shape)
                    a = o.cpu().contiguous().view(-1).view(torch.uint8).numpy()
                else:
                    _, shape, buf = o
                    a = np.asarray(buf)
                return a.view(ndt).reshape(shape) if a.size else np.empty(shape, dtype=ndt)
            if not isinstance(o, tuple):
                return o
            dtype, shape, buf = o
            tdt = _torch_dtype_for(node, dtype)
            n = len(buf)
            if n == 0:
                return torch.empty(shape, dtype=tdt)
            u8 = torch.from_numpy(np.asarray(buf))
            return u8.view(tdt).reshape(shape)

        if tree is None:
            return {name: host_tensor(name, None) for name in objs}

        made: Dict[str, Any] = {}

        def lookup(node: Dict[str, Any]) -> Any:
            name = node.get("alias") or node["n"]
            if name not in made:
                if name not in objs:
                    raise ValueError(f"tensor {name!r} is not in the file")
                made[name] = _finish_tensor(host_tensor(name, node), node)
            return made[name]

        try:
            return _state.unflatten(tree, lookup)
        except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
            raise CorruptError(
                f"step {s} of {self.root}, rank {self.rank}: the {_state.STATE_KEY} metadata "
                f"does not describe the file: {e}"
            ) from None

    def load_into(
        self,
        target: Any,
        step: StepArg = "latest",
        *,
        strict: bool = True,
    ) -> LoadResult:
        """Load a checkpoint in place into the tensors of ``target`` (e.g.
        ``{"model": model.state_dict(), "optim": opt.state_dict()}``), matched by flat
        name (``_orig_mod.`` components ignored on both sides).

        Names, dtypes, shapes and writability are checked before anything is read or
        written; a problem raises ``DestinationError`` listing every one. When ``target``
        is a dict, the checkpoint's top-level sub-trees (dicts, lists, tuples) whose key
        ``target`` does not have are left out: ``load_into({"model": sd})`` on a checkpoint
        that also holds ``optim``, ``sched`` and ``rng`` compares the ``model.*`` names
        exactly and ignores the rest (top-level tensors are always compared). With
        ``strict=False`` missing and unexpected keys are reported in the result instead. Plain values of ``target`` are
        not changed. Contiguous CPU destinations are read into directly; CUDA destinations
        through the staging memory with no host copy of your own. A step the local disk
        does not hold is read from the bucket (``remote=...``): into CUDA destinations
        through CUDA-registered staging buffers (no host copy of the file), else into host
        memory, checked, then copied into the destinations. With ``replicas > 0`` it is
        collective, as :meth:`load` is: a rank whose file is lost gets it from a partner's
        replica first.
        """
        if self._replicator is not None:
            self._replicator.agree_step(_step_sel(step))  # node-local roots: collective
        s, where = _remote.resolve(self, _step_sel(step), None)
        if self._replicator is not None and where != "remote":
            self._replicator.before_load(s)  # collective: a lost file comes from a peer
        if where == "remote":
            # The manifest's entry and the header's skeleton; the data after the planning.
            entry = _remote.rank_entry(self, s)
            tree = _remote.skeleton(self, s, self._engine.remote_file_metadata(s))
        else:
            _, entry = self._rank_entry(s)
            tree = self._skeleton(s, entry)
        aliases: Dict[str, str] = {}
        if tree is not None:
            for node in _state.tensor_nodes(tree):
                if node.get("alias"):
                    aliases[node["n"]] = node["alias"]
        flat = _state.flatten(target)
        stored = {t["name"]: t for t in entry["tensors"]}
        # Checkpoint names (stored and aliases) by canonical name.
        ck_names = list(stored) + list(aliases)
        canon: Dict[str, List[str]] = {}
        for n in ck_names:
            canon.setdefault(_canonical(n), []).append(n)

        def match(dname: str) -> Optional[str]:
            if dname in stored or dname in aliases:
                return dname
            c = canon.get(_canonical(dname))
            if c and len(c) == 1:
                return c[0]
            return None

        problems: List[str] = []
        missing: List[str] = []
        plan: Dict[str, List[Tuple[Leaf, Any]]] = {}  # stored name -> destinations
        used: set = set()
        for lf in flat.leaves:
            ck = match(lf.name)
            if ck is None:
                missing.append(lf.name)
                continue
            used.add(ck)
            src = aliases.get(ck, ck)
            t = stored.get(src)
            if t is None:
                problems.append(f"{lf.name}: alias of {src!r}, which is not in the file")
                continue
            want = _dest_dtype_name(lf)
            if want != t["dtype"] or list(lf.obj.shape) != list(t["shape"]):
                problems.append(
                    f"{lf.name}: checkpoint has {t['dtype']} {list(t['shape'])}, destination "
                    f"is {want} {list(lf.obj.shape)}"
                )
                continue
            bad = _unwritable(lf.obj)
            if bad is not None:
                problems.append(f"{lf.name}: the destination {bad}")
                continue
            plan.setdefault(src, []).append((lf, lf.obj))
        # Sub-trees of the checkpoint the target does not name are not compared.
        try:
            ignored = _unnamed_subtrees(tree, target)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CorruptError(
                f"step {s} of {self.root}, rank {self.rank}: malformed {_state.STATE_KEY} "
                f"metadata: {e}"
            ) from None
        unexpected = sorted({n for n in ck_names if n not in used and n not in ignored})
        if strict:
            problems += [f"{n}: in the destination, not in the checkpoint" for n in missing]
            problems += [f"{n}: in the checkpoint, not in the destination" for n in unexpected]
        if problems:
            raise DestinationError(
                f"cannot load step {s} of {self.root} into the given state "
                f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems)
            )
        on_cuda = any(
            torch is not None and isinstance(d, torch.Tensor) and d.device.type == "cuda"
            for dests in plan.values()
            for _, d in dests
        )
        if where == "remote" and not on_cuda:
            _, _, _, remote_tensors = self._engine.load_remote(s)
            _remote.copy_into(remote_tensors, plan)
        else:
            # (CUDA destinations from the bucket: through the registered staging buffers.)
            self._read_into(s, entry, plan, remote=where == "remote")
        return LoadResult(s, missing, unexpected)

    def _read_into(
        self, s: int, entry: Dict[str, Any], plan: Dict[str, List[Tuple[Any, Any]]], remote: bool = False
    ) -> None:
        cuda_dev = None
        for dests in plan.values():
            for _, d in dests:
                if torch is not None and isinstance(d, torch.Tensor) and d.device.type == "cuda":
                    cuda_dev = d.device
                    break
            if cuda_dev is not None:
                break
        direct: Dict[str, Any] = {}  # stored name -> destination read into directly
        copies: List[Tuple[Any, Any]] = []  # (destination, source) after the read
        scratch: Dict[str, Any] = {}
        ranges: List[Tuple[int, int]] = []

        def free_range(p: int, n: int) -> bool:
            for a, b in ranges:
                if p < b and a < p + n:
                    return False
            ranges.append((p, p + n))
            return True

        for t in entry["tensors"]:
            name = t["name"]
            dests = plan.get(name, [])
            chosen = None
            for _, d in dests:
                # Read into directly only where the memory holds the values as stored:
                # a little-endian array, a tensor with no conjugate or negative bit. The
                # others get a scratch buffer and a copy (which converts).
                if isinstance(d, np.ndarray):
                    ok = (
                        cuda_dev is None
                        and d.flags.c_contiguous
                        and d.flags.writeable
                        and _state.little_endian(d.dtype) is d.dtype
                    )
                    p, n = (int(d.ctypes.data), int(d.nbytes))
                else:
                    dd = d.detach()
                    on = dd.device.type
                    ok = (
                        dd.is_contiguous()
                        and not _state.is_lazy(dd)
                        and ((cuda_dev is None and on == "cpu") or (cuda_dev is not None and dd.device == cuda_dev))
                    )
                    p, n = (int(dd.data_ptr()), dd.numel() * dd.element_size())
                if ok and (n == 0 or free_range(p, n)):
                    chosen = d
                    break
            if chosen is None:
                tdt = _state.ST_TO_TORCH.get(t["dtype"])
                if cuda_dev is None:
                    if tdt is not None:
                        buf = torch.empty(t["shape"], dtype=tdt)
                    else:
                        buf = np.empty(t["shape"], dtype=_state.ST_TO_NUMPY[t["dtype"]])
                else:
                    buf = torch.empty(t["shape"], dtype=tdt, device=cuda_dev)
                scratch[name] = buf
                chosen = buf
            direct[name] = chosen
            for _, d in dests:
                if d is not chosen:
                    copies.append((d, chosen))
        if cuda_dev is None:
            dest = []
            for name, d in direct.items():
                if isinstance(d, np.ndarray):
                    dest.append((name, int(d.ctypes.data) if d.nbytes else 0, int(d.nbytes)))
                else:
                    nb = d.numel() * d.element_size()
                    dest.append((name, int(d.data_ptr()) if nb else 0, nb))
            self._engine.load_into(s, dest)
        else:
            device_dest: List[Tuple[str, int, int, int]] = []
            for name, d in direct.items():
                nb = d.numel() * d.element_size()
                device_dest.append((name, int(d.data_ptr()) if nb else 0, nb, cuda_dev.index))
            torch.cuda.current_stream(cuda_dev).synchronize()
            if remote:
                _remote.read_into_device(self, s, device_dest)
            else:
                self._engine.load_into_device(s, device_dest)
        with torch.no_grad() if torch is not None else contextlib.nullcontext():
            for d, src in copies:
                if isinstance(d, np.ndarray):
                    # (numpy converts to the destination's byte order)
                    d[...] = src.cpu().numpy() if not isinstance(src, np.ndarray) else src
                    continue
                if isinstance(src, np.ndarray):
                    src = torch.from_numpy(src)
                if d.is_inference():  # (updated in place only in inference mode)
                    with torch.inference_mode():
                        d.copy_(src)
                else:
                    d.copy_(src)


Leaf = _state.Leaf


def _unnamed_subtrees(tree: Any, target: Any) -> set:
    """The checkpoint names (stored and aliases) under top-level containers of the saved
    state whose key ``target`` (a mapping) does not have: ``load_into`` does not report
    them as unexpected. Empty when either side is not a dict (or the checkpoint has no
    skeleton: a flat file's tensors are all top-level)."""
    if not isinstance(target, Mapping) or not isinstance(tree, dict):
        return set()
    if tree.get("t") not in ("dict", "odict"):
        return set()
    named = set()
    for k in target.keys():
        if isinstance(k, int) and not isinstance(k, bool):
            named.add(("i", str(k)))
        elif isinstance(k, str):
            named.add(("s", k))
    out: set = set()
    for kt, k, child in tree.get("v", []):
        if (kt, str(k)) in named or not isinstance(child, dict):
            continue
        if child.get("t") in ("dict", "odict", "list", "tuple"):
            out.update(n["n"] for n in _state.tensor_nodes(child))
    return out


def _dest_dtype_name(lf: Any) -> str:
    return lf.dtype


def _unwritable(d: Any) -> Optional[str]:
    """Why ``load_into`` cannot write destination ``d`` (checked before any byte is written),
    or ``None``."""
    if isinstance(d, np.ndarray):
        if not d.flags.writeable:
            return "is a read-only numpy array"
        return None
    if torch._debug_has_internal_overlap(d) == 1:  # 1: MemOverlap::Yes
        return "has elements that share memory (an expanded view): it cannot be written"
    return None


def _torch_dtype_for(node: Optional[Dict[str, Any]], st_dtype: str) -> Any:
    if node is not None and node.get("dtype"):
        dt = getattr(torch, node["dtype"], None)
        if dt is not None and _state.TORCH_TO_ST.get(dt) == st_dtype:
            return dt
    dt = _state.ST_TO_TORCH.get(st_dtype)
    if dt is None:
        raise DestinationError(f"dtype {st_dtype} has no torch equivalent")
    return dt


def _finish_tensor(x: Any, node: Dict[str, Any]) -> Any:
    """The loaded tensor ``x`` as its skeleton node says (an ``nn.Parameter``). Raises
    ``ValueError`` for a node that cannot describe ``x`` (``load`` makes it a
    ``CorruptError``)."""
    if node.get("param") and torch is not None:
        rg = bool(node.get("requires_grad", True))
        if rg and not (x.is_floating_point() or x.is_complex()):
            raise ValueError(
                f"tensor {node.get('n')!r:.80}: a {x.dtype} parameter cannot require gradients"
            )
        return torch.nn.Parameter(x, requires_grad=rg)
    return x
