"""``Checkpointer``: its constructor, lifecycle and queries. Saving, the optimizer guard and
loading are its collaborators (``save.Saver``, ``guard.Guard``, ``load.Loader``,
``load_into.InPlaceLoad``), to which its methods delegate."""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import operator
import os
import threading
import weakref
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence, Tuple, Union, overload

from .. import _shmckpt
from .. import remote as _remote
from ..config import Cadence, RemoteTier, Replicas, Tuning, apply_legacy, engine_settings
from ..errors import ConfigError
from .base import Shared, StepArg, _dist_barrier, _dist_rank_world
from .guard import Guard
from .handle import LoadResult, SaveHandle
from .load import Loader
from .load_into import InPlaceLoad
from .save import Saver

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

#: The keyword arguments of ``Checkpointer`` (the flat ones of earlier versions aside).
_VALID = (
    "keep_last",
    "rank",
    "world_size",
    "keep_in_memory",
    "recover_on_open",
    "remote",
    "replicas",
    "cadence",
    "tuning",
    "check_replicas",
    "on_divergence",
    "shm_name",
)


class Checkpointer:
    """Checkpoints of one rank under ``root``.

    ``root`` is a writable directory (shared by all ranks), created with its missing parents
    when it does not exist (``RootCreateFailed`` says why when it cannot be). The rank and
    world size come from ``torch.distributed`` when it is initialized, else 0 of 1 (or
    give them; with ``torch.distributed``, every rank must then build its checkpointer, as
    the constructor is a collective: rank 0 broadcasts the run's session id, recorded in
    every file and manifest part so that a dead run's part never counts toward this
    run's commit of the same step number, and it ends with a barrier; ranks given
    explicitly have no session, docs/guarantees.md). ``keep_last``: retention, default
    keep all.

    The other settings come in groups, each a frozen dataclass of :mod:`shmckpt.config`
    checked when built (``ConfigError`` naming the field), the common case a shorthand::

        Checkpointer("/ckpt", keep_last=3, remote="s3://bucket/run", replicas=1)

    ``tuning=Tuning(...)``: how the engine stages and writes (``staging_capacity``,
    ``chunk_size``, ``writer_threads``, ``queue_depth``, ``copy_threads``, ``direct_io``,
    ``max_inflight_saves``, ``copy_ahead``). Without ``staging_capacity`` the staging sizes
    itself: the arena starts at 64 MiB and the first save that needs more reopens the
    engine with an arena of that save's size plus 1/16 (after the saves in flight are
    committed), bounded by the free space of ``/dev/shm`` (``ShmTooSmall``, naming
    ``staging_capacity``, when that cannot hold the save). Give it to reserve the arena
    here instead of in the first save.

    ``keep_in_memory=True`` turns on flash restore: the staging arena (in ``/dev/shm``)
    outlives the process, a crash included, holding the last committed checkpoint; the
    next ``Checkpointer`` of the same root and rank loads that step from memory when it is
    still the newest on disk and every CRC-32C matches the committed manifest, else from
    disk (the reason is logged). :attr:`last_load_source` says which path served a load.
    ``shmckpt shm list`` / ``shmckpt shm rm`` manage kept arenas. Off by default.
    ``recover_on_open`` (default on): commit what a crashed predecessor's staging memory
    holds. ``shm_name``: the staging segment's name in ``/dev/shm``.

    ``remote="s3://bucket/prefix"`` (or ``RemoteTier(url, keep_last=..., max_pending=...,
    part_size=..., concurrency=..., request_timeout=..., complete_timeout=...,
    every=...)``) mirrors every committed save to a bucket (credentials and endpoint from
    the AWS environment variables; the upload starts with the save, from the staging
    memory, and completes once the save is committed on disk): ``handle.wait_remote()``
    waits for the step to be committed there, ``list(remote=True)`` lists the bucket, and
    loads fall back to it. A root of ``s3://...`` keeps no checkpoint on disk (its
    ``RemoteTier``, when given, names the same URL). See ``docs/remote.md``.

    ``replicas=k`` (or ``Replicas(k, node=..., group=..., bandwidth=..., timeout=...,
    node_local_root=...)``) keeps each rank's committed file in the memory of ``k`` ranks
    on other machines; with ``node_local_root=True`` ``root`` is this machine's own disk
    and every step commits through the process group (in the replication thread:
    ``wait_replicated()``, not ``wait()``, says it is committed); see ``docs/replicas.md``.

    ``cadence=Cadence(disk_every=N, disk_interval_s=...)`` sends every ``N``-th save to
    disk (``"auto"``: when the previous disk save has finished); the other saves are
    **memory-only**: staged in shared memory (``handle.wait()`` returns once staged, its
    report's ``memory_only`` true), loadable in this process (``last_load_source`` is
    ``("memory", None)``), committed to disk by the next open after a crash of the
    process (``recover_on_open``), and written to disk by ``close()``; not uploaded, but
    replicated with ``replicas``. ``"auto"`` and ``disk_interval_s`` decide per rank: refused with several
    ranks. ``Cadence(memory_steps=n)`` (default 1): the memory tier holds the ``n`` newest
    memory-only steps saved since the last disk save (each loadable and listed, each
    recovered after a crash, all written to disk by ``close()``); staging holds ``(2 + n)``
    saves for none to be given up (an older one is given up first, never the newest).
    With ``replicas``, ``Replicas(every=k)`` (default 1) replicates every ``k``-th save
    (counted in saves, disk and memory-only alike: the first, then every ``k``-th after
    the last replicated one); a memory-only step is sent from a copy of its staging
    chunks with the checksums computed then, and its replicas serve a lost rank once the
    step is committed (``close()`` writes it; see ``docs/replicas.md``). See
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

    The flat keyword arguments of earlier versions (``chunk_size=``,
    ``remote_keep_last=``, ``replica_group=``, ``disk_every=``, ...) are still accepted,
    with a ``DeprecationWarning`` naming the grouped spelling
    (:func:`shmckpt.config.apply_legacy`); any other keyword is a ``TypeError`` naming the
    closest valid one.

    The class delegates to collaborators built here: a :class:`~.save.Saver`, a
    :class:`~.guard.Guard`, a :class:`~.load.Loader` (with the in-place
    :class:`~.load_into.InPlaceLoad`), the replicator and the replica check, all given one
    :class:`~.base.Shared` state (identity, engine, saves in flight).
    """

    def __init__(
        self,
        root: Union[str, os.PathLike],
        *,
        keep_last: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        keep_in_memory: bool = False,
        recover_on_open: Optional[bool] = None,
        remote: Union[str, RemoteTier, None] = None,
        replicas: Union[int, Replicas, None] = None,
        cadence: Optional[Cadence] = None,
        tuning: Optional[Tuning] = None,
        check_replicas: Any = None,
        on_divergence: Any = "raise",
        shm_name: Optional[str] = None,
        **legacy: Any,
    ):
        root = os.fspath(root)
        # A remote-only root (``s3://...``) is its own remote tier: flat remote settings
        # of earlier versions apply to it.
        bucket_root = isinstance(root, str) and root.startswith("s3://")
        tier_arg: Union[str, RemoteTier, None] = remote
        if bucket_root and remote is None:
            tier_arg = root
        elif bucket_root and isinstance(remote, RemoteTier) and remote.url == root:
            remote = None  # the root's own tier, with its settings
        groups = apply_legacy(
            "Checkpointer",
            {"tuning": tuning, "remote": tier_arg, "replicas": replicas, "cadence": cadence},
            legacy,
            _VALID,
        )
        tier: Optional[RemoteTier] = groups["remote"]
        reps: Optional[Replicas] = groups["replicas"]
        if reps is not None and not reps.active:
            reps = None  # Replicas(k=0): no replication tier
        r, w = _dist_rank_world()
        self.rank = r if rank is None else int(rank)
        self.world_size = w if world_size is None else int(world_size)
        self.root = root
        #: The bucket every committed save is mirrored to (``s3://bucket/prefix``), or None.
        self.remote: Optional[str] = tier.url if tier is not None else None
        # Remote only (`Checkpointer("s3://...")`): a private scratch directory as the
        # engine's root, emptied after each upload started (see shmckpt.remote).
        self._scratch, engine_root, remote_only = _remote.scratch_for(
            self.root, remote.url if isinstance(remote, RemoteTier) else remote
        )
        # Ranks of one run share a session id (rank 0's, broadcast), recorded in every
        # file's header and manifest part: a part of a dead run (a rank's save of a step
        # the run never committed) never counts toward this run's commit of that step
        # number, on disk or in the bucket. Without torch.distributed there is nobody to
        # agree with: no session (`session=` of the engine, docs/guarantees.md).
        session = None
        if self.world_size > 1 and rank is None and world_size is None:
            session = _remote.shared_session()
        settings = engine_settings(
            groups["tuning"],
            tier,
            groups["cadence"],
            rank=self.rank,
            world_size=self.world_size,
            keep_last=keep_last,
            shm_name=shm_name,
            recover_on_open=recover_on_open,
            keep_in_memory=bool(keep_in_memory),
            create_root=True,
            remote_only=remote_only,
            session=session,
            # Replication sends each committed image from its staging chunks.
            replica_hold=reps is not None and reps.k > 0,
        )
        try:
            engine = _shmckpt.Engine(engine_root, settings)
        except BaseException:
            if self._scratch is not None:
                _remote.remove_scratch(self._scratch)
            raise
        shared = Shared(self.root, self.rank, self.world_size, self.remote, engine)
        self._shared = shared
        #: The steps this checkpointer's open recovered from the staging memory of a crashed
        #: predecessor of the same root and rank (saves that had returned from ``save`` but
        #: were not committed), oldest first; committed now, or (flash restore with a disk
        #: cadence, the same settings) the newest held in memory as this checkpointer's
        #: memory-only step, so ``latest()`` sees them. Older saves of a taken-over kept
        #: arena are committed by a thread after the open (not listed here).
        self.recovered: List[int] = engine.recovered()
        #: Where opening spent its time, in seconds per phase: ``recovery`` (committing a
        #: crashed predecessor's staged saves), ``clean`` (stale partial directories),
        #: ``arena`` (taking the kept arena over and checking its image, or creating a new
        #: one), ``writers`` (the io_uring rings) and ``total``.
        self.open_timings: Dict[str, float] = dict(engine.open_timings())
        if self.recovered:
            _log.warning("shmckpt: recovered step(s) %s of %s from a crashed run's staging memory", self.recovered, self.root)
        unrecovered = engine.unrecovered()
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
        self._guard = Guard(shared)
        self._saver = Saver(shared, self._guard)
        self._loader = Loader(shared)
        self._in_place = InPlaceLoad(self._loader)
        try:
            if check_replicas is not None:
                from .._divergence import ReplicaCheck

                if reps is not None:
                    raise ConfigError(
                        "check_replicas cannot be combined with replicas > 0 or node_local_root yet "
                        "(their commits run in the replication thread)"
                    )
                shared.checker = ReplicaCheck(self.rank, check_replicas, on_divergence)
            if reps is not None:
                from ..replicas import Replicator

                shared.replicator = Replicator(
                    shared,
                    reps.k,
                    reps.node,
                    reps.group,
                    bandwidth=reps.bandwidth,
                    timeout=reps.timeout,
                    node_local=reps.node_local_root,
                    keep_last=keep_last,
                    replicate_every=reps.every or 1,
                    disk_every=groups["cadence"].disk_every if groups["cadence"] is not None else 1,
                )
        except BaseException:
            engine.close()
            raise
        OPEN_CHECKPOINTERS.add(self)

    # -- what tests and benchmarks reach: the collaborators' state, by its old names --
    @property
    def _engine(self) -> Any:
        return self._shared.engine

    @_engine.setter
    def _engine(self, engine: Any) -> None:
        self._shared.engine = engine

    @property
    def _layout(self) -> Optional[Any]:
        return self._saver.layout

    @_layout.setter
    def _layout(self, layout: Optional[Any]) -> None:
        self._saver.layout = layout

    @property
    def _replicator(self) -> Optional[Any]:
        return self._shared.replicator

    def _rank_entry(self, step: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        return self._shared.rank_entry(step)

    def _check_all_or_refuse(self) -> None:
        """At close: the replica check of every save not checked yet, a collective; the
        commits of those it cannot check (the process group is gone, or failed) are
        refused, never left waiting."""
        checker = self._shared.checker
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
        src = self._shared.engine.last_load_source()
        if self._shared.replicator is not None:
            return self._shared.replicator.source(src)
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
        if self._shared.replicator is not None:
            self._shared.replicator.close()  # the queued replications finish first
        if self._shared.checker is not None:
            self._check_all_or_refuse()
        shared = self._shared
        for h in list(shared.pending):
            try:
                h._get_rust()
            except Exception:
                pass  # a submission that failed: its handle reports the error
        self._saver.close()
        self._guard.remove_all()
        shared.engine.close()
        with shared.lock:
            pending, shared.pending = shared.pending, []
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
        return self._shared.engine.describe()[0]

    @property
    def staging_capacity(self) -> int:
        """Largest checkpoint file (bytes) a save can stage."""
        return self._shared.engine.describe()[1]

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
        got = self._shared.engine.latest_in(source)
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
        got = self._shared.engine.list_in(source)
        if tiers:
            return [(int(s), list(t)) for s, t in got]
        return [int(s) for s, _ in got]

    def manifest(self, step: StepArg = "latest") -> Dict[str, Any]:
        """The manifest of a committed checkpoint (files, tensors, offsets, CRC-32C)."""
        return self._shared.manifest(step)

    def remove(self, step: int) -> None:
        """Delete committed checkpoint ``step`` (all ranks' files): it leaves the listing at
        once, durably (renamed to a trash name), then its files are deleted. ``NotFound``
        when it is not committed, or when its save is still in flight (wait for that
        handle first). For retention driven by the caller (``keep_last`` does it
        automatically otherwise)."""
        self._shared.engine.remove(operator.index(step))

    def flush(self) -> None:
        """Wait for every save in flight to be committed or to fail (with
        ``check_replicas``, after the replica check of each: a collective). A memory-only
        step (``disk_every``) stays in memory: ``close()`` writes it to disk."""
        if self._shared.checker is not None:
            self._shared.checker.check_through(None)
        self._shared.engine.flush()
        self._shared.reap()

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
            self._shared.engine.prepare_cuda_background(list(devices))
            return None
        return self._shared.engine.prepare_cuda(list(devices))

    def staging_ready(self) -> bool:
        """True once the staging memory is wholly allocated (the constructor allocates it
        in the background) and no background CUDA registration is running: a save then
        pays no one-time cost."""
        return self._shared.engine.staging_ready()

    def wait_staging_ready(self) -> None:
        """Wait until the staging memory is wholly allocated and registered. Raises
        ``ShmTooSmall`` if ``/dev/shm`` filled up before it was."""
        self._shared.engine.wait_staging_ready()

    # -- saving, the guard and loading: the collaborators' -----------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        blocking: bool = True,
        metadata: Optional[Mapping[str, str]] = None,
        snapshot: Optional[str] = None,
    ) -> SaveHandle:
        return self._saver.save(step, state, blocking=blocking, metadata=metadata, snapshot=snapshot)

    save.__doc__ = Saver.save.__doc__

    def wait_staged(self) -> None:
        self._saver.wait_staged()

    wait_staged.__doc__ = Saver.wait_staged.__doc__

    def wait(self) -> None:
        self._saver.wait()

    wait.__doc__ = Saver.wait.__doc__

    def guard(self, optimizer: Any) -> None:
        self._guard.guard(optimizer)

    guard.__doc__ = Guard.guard.__doc__

    def unguard(self, optimizer: Any) -> None:
        self._guard.unguard(optimizer)

    unguard.__doc__ = Guard.unguard.__doc__

    def load(self, step: StepArg = "latest", *, map_location: Any = None, source: Optional[str] = None) -> Any:
        return self._loader.load(step, map_location=map_location, source=source)

    load.__doc__ = Loader.load.__doc__

    def load_into(self, target: Any, step: StepArg = "latest", *, strict: bool = True) -> LoadResult:
        return self._in_place.run(target, step, strict=strict)

    load_into.__doc__ = InPlaceLoad.run.__doc__
