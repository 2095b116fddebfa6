"""``Checkpointer``: its constructor, lifecycle and queries. Saving, the optimizer guard and
loading are the mixins of ``save.py``, ``guard.py``, ``load.py`` and ``load_into.py``."""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import operator
import os
import threading
import weakref
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union, overload

from .. import _shmckpt
from .. import remote as _remote
from ..errors import ConfigError, NotFound
from .base import StepArg, _dist_barrier, _dist_rank_world, _step_sel
from .handle import SaveHandle
from .load_into import LoadIntoMixin
from .save import SaveMixin

_log = logging.getLogger("shmckpt")

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]


class _OpenCheckpointers:
    """The checkpointers of this process not yet closed, held weakly.

    Process-wide because the interpreter's exit must find them: its ``atexit`` hook
    (:meth:`close_all`) finishes their saves in flight and removes their staging segments
    from ``/dev/shm``, which a checkpointer never closed would otherwise leave there. One
    instance, :data:`OPEN_CHECKPOINTERS`; a checkpointer adds itself when its constructor
    succeeds and removes itself in ``close``."""

    def __init__(self) -> None:
        self._open: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, ck: "Checkpointer") -> None:
        with self._lock:
            self._open.add(ck)

    def discard(self, ck: "Checkpointer") -> None:
        with self._lock:
            self._open.discard(ck)

    def close_all(self) -> None:
        """Close every open checkpointer (best effort: the interpreter is exiting)."""
        with self._lock:
            open_now = list(self._open)
        for ck in open_now:
            try:
                ck.close()
            except Exception:  # pragma: no cover - best effort at exit
                pass


#: The open checkpointers of this process (see :class:`_OpenCheckpointers` for why).
OPEN_CHECKPOINTERS = _OpenCheckpointers()
atexit.register(OPEN_CHECKPOINTERS.close_all)


class Checkpointer(SaveMixin, LoadIntoMixin):
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
    and endpoint from the AWS environment variables; the upload starts with the save, from
    the staging memory, and completes once the save is committed on disk):
    ``handle.wait_remote()`` waits for the step to be committed there, ``remote_keep_last`` is the bucket's retention,
    ``remote_max_pending`` (default 2) the saves that may wait for the uploader before the
    oldest waiting one is skipped, ``remote_part_size`` (bytes, 5 MiB to 1 GiB, default
    16 MiB) and ``remote_concurrency`` (1 to 256, default 8) the multipart part size and
    the parts or ranged GETs in flight (under staging pressure the upload pins at most
    ``concurrency x part_size`` of staging), ``remote_request_timeout`` (seconds, default 30)
    how long one request may take before it fails and is retried, ``remote_complete_timeout``
    (seconds, default 600) how long the server may take to assemble an object at the end of
    its multipart upload, ``list(remote=True)`` lists the bucket, and loads fall
    back to it. A root of ``s3://...`` keeps no checkpoint on disk. See ``docs/remote.md``.

    ``replicas=k`` (with ``node``, ``replica_group``, ``replica_bandwidth``: bytes per
    second each rank sends replicas at, at most, default 1 GiB/s, ``None`` unbounded;
    ``replica_timeout``: seconds a replication step waits for a peer, default 300) keeps
    each rank's committed file in the memory of ``k`` ranks on other machines;
    ``node_local_root=True`` (with ``replicas > 0``): ``root`` is this machine's own disk,
    not shared, and every step commits through the process group (in the replication
    thread: ``wait_replicated()``, not ``wait()``, says it is committed); see
    ``docs/replicas.md``.

    ``disk_every=N`` (default 1: every save) sends every ``N``-th save to disk (the first
    save, then every ``N``-th after the last disk save); ``disk_every="auto"``: a save goes
    to disk when the previous disk save has finished, so the disk takes every save it can
    sustain. ``disk_interval_s``: a save also goes to disk when that many seconds have
    passed since the last disk save began. The other saves are **memory-only**: staged in
    shared memory (``handle.wait()`` returns once staged, its report's ``memory_only``
    true), loadable in this process (``load("latest")``, ``last_load_source`` is
    ``("memory", None)``), committed to disk by the next open after a crash of the process
    (``recover_on_open``), and written to disk by ``close()``; not uploaded, not
    replicated. ``"auto"`` and ``disk_interval_s`` decide per rank: refused with several
    ranks. With ``replicas``, ``replicate_every=k`` (default 1) replicates every ``k``-th
    disk save (counted in disk saves: the first, then every ``k``-th after the last
    replicated one); memory-only saves are not replicated (see ``docs/replicas.md``). ``remote_every=k`` (with
    ``remote=...``): every ``k``-th disk save is also uploaded (default 1: every disk
    save). ``memory_steps=n`` (default 1): the memory tier holds the ``n`` newest
    memory-only steps saved since the last disk save (each loadable and listed, each
    recovered after a crash, all written to disk by ``close()``); staging holds
    ``(2 + n)`` saves for none to be given up, else the oldest is given up first. See
    ``docs/python.md``.

    ``check_replicas=group`` (a ``torch.distributed`` process group of data-parallel
    ranks, e.g. a gloo group): before a step is committed, the ranks of the group compare
    the CRC-32Cs of the tensors they all hold (same name, dtype and shape); when a copy
    differs the step is not committed and ``handle.wait()`` raises
    :class:`~shmckpt.errors.ReplicaDivergence` naming the tensor and the ranks
    (``on_divergence="warn"``: committed, with a warning; a callable taking the error:
    committed when it returns True on every rank of the group). The check is a collective
    run in ``handle.wait()``, ``wait()``, ``flush()``, ``close()`` and at the start of the
    next ``save()``; the step commits only then. See ``docs/guarantees.md``.
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
        remote_part_size: Optional[int] = None,
        remote_concurrency: Optional[int] = None,
        remote_request_timeout: Optional[float] = None,
        remote_complete_timeout: Optional[float] = None,
        check_replicas: Any = None,
        on_divergence: Any = "raise",
        disk_every: Union[int, str] = 1,
        disk_interval_s: Optional[float] = None,
        remote_every: int = 1,
        memory_steps: int = 1,
        replicate_every: int = 1,
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
                remote_part_size=remote_part_size,
                remote_concurrency=remote_concurrency,
                remote_request_timeout=remote_request_timeout,
                remote_complete_timeout=remote_complete_timeout,
                remote_only=remote_only,
                remote_session=session,
                # Replication sends each committed image from its staging chunks.
                replica_hold=bool(replicas),
                # Which saves go to disk is decided by the engine, per save.
                disk_every=disk_every,
                disk_interval_s=disk_interval_s,
                remote_every=remote_every,
                memory_steps=memory_steps,
            )
        except BaseException:
            if self._scratch is not None:
                _remote.remove_scratch(self._scratch)
            raise
        #: The steps this checkpointer's open recovered from the staging memory of a crashed
        #: predecessor of the same root and rank (saves that had returned from ``save`` but
        #: were not committed), oldest first; committed now, so ``latest()`` sees them.
        self.recovered: List[int] = self._engine.recovered()
        if self.recovered:
            _log.warning("shmckpt: recovered step(s) %s of %s from a crashed run's staging memory", self.recovered, self.root)
        unrecovered = self._engine.unrecovered()
        if unrecovered:
            _log.warning(
                "shmckpt: staging memory of crashed runs (%s) holds saves of %s not recovered%s; "
                "kept, with their partial directories: run `shmckpt recover %s`",
                ", ".join(unrecovered),
                self.root,
                " (recover_on_open=False)" if recover_on_open is False else "",
                self.root,
            )
        if rank is None and world_size is None and self.world_size > 1:
            _dist_barrier()
        self._pending: List[SaveHandle] = []
        self._guards: List[Tuple[Any, Any]] = []  # (weakref to optimizer, hook handle)
        self._submitter: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._layout: Optional[Any] = None  # _layout.Layout of the last save (save.py)
        self._lock = threading.Lock()
        self._replicator: Optional[Any] = None
        self._checker: Optional[Any] = None
        if check_replicas is not None:
            from .._divergence import ReplicaCheck

            try:
                if replicas or node_local_root:
                    raise ConfigError(
                        "check_replicas cannot be combined with replicas > 0 or node_local_root yet "
                        "(their commits run in the replication thread)"
                    )
                self._checker = ReplicaCheck(self.rank, check_replicas, on_divergence)
            except BaseException:
                self._engine.close()
                raise
        if replicas or node_local_root:
            from ..replicas import Replicator

            try:
                self._replicator = Replicator(
                    self,
                    replicas,
                    node,
                    replica_group,
                    bandwidth=replica_bandwidth,
                    timeout=replica_timeout,
                    node_local=node_local_root,
                    keep_last=keep_last,
                    replicate_every=replicate_every,
                    disk_every=disk_every,
                )
            except BaseException:
                self._engine.close()
                raise
        OPEN_CHECKPOINTERS.add(self)

    def _check_all_or_refuse(self) -> None:
        """At close: the replica check of every save not checked yet, a collective; the
        commits of those it cannot check (the process group is gone, or failed) are
        refused, never left waiting."""
        checker = self._checker
        assert checker is not None
        dist = checker._dist
        try:
            if dist.is_available() and dist.is_initialized():
                checker.check_through(None)
        except Exception as e:
            checker.refuse_all(f"replica check at close failed: {type(e).__name__}: {e}")
        else:
            checker.refuse_all("the process group was gone at close: replicas not checked")

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
        """Wait for the saves in flight, write the held memory-only steps (``disk_every``,
        ``memory_steps``) to disk, then release the staging memory. Idempotent (also done at interpreter exit
        for checkpointers still open).

        Safe to call while another thread uses this checkpointer: the engine's ``close``
        returns only once every save it started is committed or failed (it waits for a
        call in progress on another thread, and a second ``close`` waits for the first),
        so the tensors kept for non-blocking saves are dropped only when nothing reads
        them any more. Calls that begin after it raise ``ShutdownError``."""
        OPEN_CHECKPOINTERS.discard(self)
        if self._replicator is not None:
            self._replicator.close()  # the queued replications finish first
        if self._checker is not None:
            self._check_all_or_refuse()
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

    # -- queries -----------------------------------------------------------------------
    def latest(self, *, source: Optional[str] = None) -> Optional[int]:
        """The step ``load("latest", source=source)`` loads, or ``None`` when no tier asked
        holds a committed step: the same rule as the load (the engine's one fallback
        order). ``source=None``: the local disk's newest step (served from memory when the
        kept image holds it) when the disk holds any, else the bucket's (``remote=...``),
        so a lost local root does not hide the bucket; ``"local"``: memory or disk only;
        ``"remote"``: the bucket only. With replicas, ``load("latest")`` is collective and
        may pick an older step that every rank can load (or a step a partner holds for a
        rank whose files are gone): this is the rank's own view, without a collective."""
        _remote.check_source(source)
        if source == "remote" and self.remote is None:
            raise ConfigError("this Checkpointer has no remote tier (remote=...)")
        got = self._engine.latest_in(source)
        return None if got is None else int(got)

    @overload
    def list(self, remote: bool = ..., *, source: Optional[str] = ..., tiers: Literal[False] = ...) -> List[int]: ...

    @overload
    def list(
        self, remote: bool = ..., *, source: Optional[str] = ..., tiers: Literal[True]
    ) -> List[Tuple[int, List[str]]]: ...

    def list(
        self, remote: bool = False, *, source: Optional[str] = None, tiers: bool = False
    ) -> Union[List[int], List[Tuple[int, List[str]]]]:
        """The committed steps ``load(step, source=source)`` can load, oldest first:
        ``source=None``, those of the local disk and of the bucket (``remote=...``), a step
        the disk holds read from the disk; ``"local"``: the disk's; ``"remote"`` (or
        ``remote=True``): the bucket's. ``tiers=True``: each as ``(step, tiers)``, the tiers
        that hold it (``"memory"``: a memory-only step of ``disk_every`` or the kept image,
        ``"disk"``, ``"bucket"``). ``latest()`` is the memory-only step when it is the
        newest, else the disk's newest when the disk holds any step, even when the bucket
        holds newer ones (listed here)."""
        if remote:
            if source not in (None, "remote"):
                raise ValueError(f"remote=True lists the bucket; source={source!r} contradicts it")
            source = "remote"
        _remote.check_source(source)
        if source == "remote" and self.remote is None:
            raise ConfigError("this Checkpointer has no remote tier (remote=...)")
        got = self._engine.list_in(source)
        if tiers:
            return [(int(s), list(t)) for s, t in got]
        return [int(s) for s, _ in got]

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
        """Wait for every save in flight to be committed or to fail (with
        ``check_replicas``, after the replica check of each: a collective). A memory-only
        step (``disk_every``) stays in memory: ``close()`` writes it to disk."""
        if self._checker is not None:
            self._checker.check_through(None)
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
        # Memory or disk, as a local load of "latest" (a memory-only step when newest).
        latest = self._engine.latest_in("local")
        if latest is None:
            raise NotFound(f"no committed checkpoint (latest) in {self.root}", path=self.root)
        return latest
