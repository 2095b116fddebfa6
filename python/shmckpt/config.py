"""The settings of a :class:`~shmckpt.Checkpointer`, grouped.

The common case is one line::

    Checkpointer("/ckpt", keep_last=3, remote="s3://bucket/run", replicas=1)

and each tier's details, when needed, are one frozen dataclass::

    Checkpointer(
        "/ckpt",
        keep_last=3,
        remote=RemoteTier("s3://bucket/run", keep_last=10, part_size=64 << 20),
        replicas=Replicas(k=1, bandwidth=2 << 30),
        cadence=Cadence(disk_every=4),
        tuning=Tuning(writer_threads=8, staging_capacity=8 << 30),
    )

Each group checks its fields when it is built (:class:`~shmckpt.errors.ConfigError`
naming the field); what depends on several settings or on the machine (the chunk size's
bounds, ``/dev/shm``) is checked by the engine when the checkpointer opens.

The flat keyword arguments of earlier versions (``chunk_size=``, ``remote_keep_last=``,
``replica_group=``, ``disk_every=``, ...) are still accepted: :func:`apply_legacy`, the one
place that maps them onto the groups, warns (``DeprecationWarning``) and names the new
spelling. :data:`TUNING_FIELDS` is what ``ShmckptWriter``, the Megatron strategy,
``dcp.prepare`` and the Lightning plugin take as ``tuning=``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import warnings
from dataclasses import dataclass, fields
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple, Union

from .errors import ConfigError

__all__ = ["Tuning", "RemoteTier", "Replicas", "Cadence", "TUNING_FIELDS"]


def _int(owner: str, name: str, v: Any, lo: int = 1, hi: Optional[int] = None, none: bool = True) -> Optional[int]:
    """``v`` as an int in ``lo..=hi`` (``None`` passes when ``none``), else ``ConfigError``
    naming ``owner.name``."""
    if v is None and none:
        return None
    if isinstance(v, bool):
        raise ConfigError(f"{owner}.{name} must be an int, not {v!r}")
    try:
        n = operator.index(v)
    except TypeError:
        raise ConfigError(f"{owner}.{name} must be an int, not {type(v).__name__} {v!r}") from None
    if n < lo or (hi is not None and n > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise ConfigError(f"{owner}.{name} must be {bound}, not {n}")
    return n


def _seconds(owner: str, name: str, v: Any, none: bool = True) -> Optional[float]:
    """``v`` as a positive, finite number of seconds (``None`` passes when ``none``)."""
    if v is None and none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{owner}.{name} must be a number of seconds, not {v!r}") from None
    f = float(v)
    if not math.isfinite(f) or f <= 0:
        raise ConfigError(f"{owner}.{name} must be a positive, finite number of seconds, not {v!r}")
    return f


def _bool(owner: str, name: str, v: Any, none: bool = True) -> Optional[bool]:
    if v is None and none:
        return None
    if not isinstance(v, bool):
        raise ConfigError(f"{owner}.{name} must be True or False, not {v!r}")
    return v


def _set(obj: Any, name: str, v: Any) -> None:
    object.__setattr__(obj, name, v)  # (frozen: normalized once, in __post_init__)


@dataclass(frozen=True)
class Tuning:
    """How the engine stages and writes; every field ``None`` takes the engine's default.

    ``staging_capacity``: bytes of shared-memory staging, the largest checkpoint file a
    save can stage (not given: it sizes itself from the first save, see
    :class:`~shmckpt.Checkpointer`). ``chunk_size``: bytes per staging chunk (a multiple
    of 4096 between 64 KiB and 1 GiB). ``writer_threads`` (1..256), ``queue_depth``
    (io_uring entries per writer, 1..4096), ``copy_threads`` (threads copying into
    staging), ``direct_io`` (``O_DIRECT`` writes where the filesystem allows),
    ``max_inflight_saves`` (1..256), ``copy_ahead`` (bytes of a save's device-to-host
    copies queued ahead of their completion, default 256 MiB; 0 queues them all at once,
    whose thousands of driver calls can delay the trainer's kernel launches while the copy
    runs: docs/python.md), ``stream_latches`` (default off: a guarded optimizer step's thread
    waits until a save's last device copies are queued; on: the step waits for them on the
    device and its thread goes on at once: docs/python.md), ``blocking_sync`` (default off:
    the engine's staging thread spins on a core while it waits for its device copies; on:
    it sleeps: docs/python.md)."""

    staging_capacity: Optional[int] = None
    chunk_size: Optional[int] = None
    writer_threads: Optional[int] = None
    queue_depth: Optional[int] = None
    copy_threads: Optional[int] = None
    direct_io: Optional[bool] = None
    max_inflight_saves: Optional[int] = None
    copy_ahead: Optional[int] = None
    stream_latches: Optional[bool] = None
    blocking_sync: Optional[bool] = None

    def __post_init__(self) -> None:
        _set(self, "staging_capacity", _int("Tuning", "staging_capacity", self.staging_capacity))
        _set(self, "chunk_size", _int("Tuning", "chunk_size", self.chunk_size))
        _set(self, "writer_threads", _int("Tuning", "writer_threads", self.writer_threads, 1, 256))
        _set(self, "queue_depth", _int("Tuning", "queue_depth", self.queue_depth, 1, 4096))
        _set(self, "copy_threads", _int("Tuning", "copy_threads", self.copy_threads, 1))
        _set(self, "direct_io", _bool("Tuning", "direct_io", self.direct_io))
        _set(self, "max_inflight_saves", _int("Tuning", "max_inflight_saves", self.max_inflight_saves, 1, 256))
        _set(self, "copy_ahead", _int("Tuning", "copy_ahead", self.copy_ahead, 0))
        _set(self, "stream_latches", _bool("Tuning", "stream_latches", self.stream_latches))
        _set(self, "blocking_sync", _bool("Tuning", "blocking_sync", self.blocking_sync))

    def given(self) -> Dict[str, Any]:
        """The fields set (not ``None``), by name: the engine's settings of the same names."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def with_staging_at_least(self, need: int) -> "Tuning":
        """This tuning with ``staging_capacity`` raised to ``need`` bytes when smaller."""
        return dataclasses.replace(self, staging_capacity=max(self.staging_capacity or 0, int(need)))


#: The fields of :class:`Tuning`, in order.
TUNING_FIELDS: Tuple[str, ...] = tuple(f.name for f in fields(Tuning))


@dataclass(frozen=True)
class RemoteTier:
    """The bucket every committed save is mirrored to (``remote=``; a plain
    ``"s3://bucket/prefix"`` is ``RemoteTier(url)``). See ``docs/remote.md``.

    ``keep_last``: the bucket's retention (``None`` keeps all). ``max_pending`` (default 2):
    the saves that may wait for the uploader before the oldest waiting one is skipped.
    ``part_size`` (bytes, 5 MiB to 1 GiB, default 16 MiB) and ``concurrency`` (1 to 256,
    default 8): the multipart part size and the parts or ranged GETs in flight.
    ``request_timeout`` (seconds, default 30): how long one request may take before it is
    retried. ``complete_timeout`` (seconds, default 600): how long the server may take to
    assemble an object. ``every`` (default 1): every ``every``-th disk save is uploaded."""

    url: str
    keep_last: Optional[int] = None
    max_pending: Optional[int] = None
    part_size: Optional[int] = None
    concurrency: Optional[int] = None
    request_timeout: Optional[float] = None
    complete_timeout: Optional[float] = None
    every: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ConfigError(f"RemoteTier.url must be an s3://bucket/prefix URL, not {self.url!r}")
        _set(self, "keep_last", _int("RemoteTier", "keep_last", self.keep_last))
        _set(self, "max_pending", _int("RemoteTier", "max_pending", self.max_pending))
        _set(self, "part_size", _int("RemoteTier", "part_size", self.part_size, 5 << 20, 1 << 30))
        _set(self, "concurrency", _int("RemoteTier", "concurrency", self.concurrency, 1, 256))
        _set(self, "request_timeout", _seconds("RemoteTier", "request_timeout", self.request_timeout))
        _set(self, "complete_timeout", _seconds("RemoteTier", "complete_timeout", self.complete_timeout))
        _set(self, "every", _int("RemoteTier", "every", self.every, none=False))


#: Bytes per second each rank sends replicas at by default.
DEFAULT_REPLICA_BANDWIDTH = float(1 << 30)


@dataclass(frozen=True)
class Replicas:
    """Peer replicas (``replicas=``; a plain int ``k`` is ``Replicas(k=k)``): each rank's
    committed file is kept in the memory of ``k`` ranks on other machines. See
    ``docs/replicas.md``.

    ``node``: this machine's name (default: the host name). ``group``: the
    ``torch.distributed`` process group to replicate in (default: the world).
    ``bandwidth``: bytes per second each rank sends replicas at, at most (default
    1 GiB/s; ``None`` unbounded). ``timeout``: seconds a replication step waits for a peer
    (default 300). ``node_local_root=True``: ``root`` is this machine's own disk, not
    shared, and every step commits through the process group (``k`` may then be 0).
    ``every``: the replication cadence, counted in saves, disk and memory-only saves of a
    ``Cadence`` alike (the first, then every ``every``-th after the last replicated one);
    default 1: every save. A memory-only step is sent from a copy of its staging chunks,
    with every tensor's CRC-32C computed from the copy, and serves a lost rank once it is
    committed (``close()`` writes it)."""

    k: int = 1
    node: Optional[str] = None
    group: Any = None
    bandwidth: Optional[float] = DEFAULT_REPLICA_BANDWIDTH
    timeout: float = 300.0
    node_local_root: bool = False
    every: Optional[int] = None

    def __post_init__(self) -> None:
        _set(self, "k", _int("Replicas", "k", self.k, lo=0, none=False))
        if self.node is not None and not isinstance(self.node, str):
            raise ConfigError(f"Replicas.node must be a str, not {self.node!r}")
        if self.bandwidth is not None:
            _set(self, "bandwidth", _seconds("Replicas", "bandwidth", self.bandwidth))
        _set(self, "timeout", _seconds("Replicas", "timeout", self.timeout, none=False))
        _bool("Replicas", "node_local_root", self.node_local_root, none=False)
        _set(self, "every", _int("Replicas", "every", self.every))

    @property
    def active(self) -> bool:
        """Whether the replication tier runs (``k > 0`` or a node-local root)."""
        return self.k > 0 or self.node_local_root


@dataclass(frozen=True)
class Cadence:
    """Which saves go to disk (``cadence=``); the others are memory-only (staged in shared
    memory, written to disk by ``close()`` or recovered by the next open after a crash).

    ``disk_every=N`` (default 1: every save): the first save, then every ``N``-th after
    the last disk save; ``"auto"``: a save goes to disk when the previous disk save has
    finished (a dead trainer's saves recovered behind the open count as one until they
    are committed). ``disk_interval_s``: a save also goes to disk when that many seconds have
    passed since the last disk save began. ``"auto"`` and ``disk_interval_s`` decide per
    rank: refused with several ranks. ``memory_steps`` (1 to 256, default 1): how many of
    the newest memory-only steps the memory tier holds (each loadable, listed, recovered
    after a crash and written to disk by ``close()``); staging holds ``2 + memory_steps``
    saves for none to be given up early (an older one is given up first, never the
    newest)."""

    disk_every: Union[int, str] = 1
    disk_interval_s: Optional[float] = None
    memory_steps: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.disk_every, str):
            if self.disk_every != "auto":
                raise ConfigError(f'Cadence.disk_every must be a number >= 1 or "auto", not {self.disk_every!r}')
        else:
            _set(self, "disk_every", _int("Cadence", "disk_every", self.disk_every, none=False))
        _set(self, "disk_interval_s", _seconds("Cadence", "disk_interval_s", self.disk_interval_s))
        _set(self, "memory_steps", _int("Cadence", "memory_steps", self.memory_steps, hi=256, none=False))


# -- the flat keyword arguments of earlier versions -------------------------------------

#: Each flat keyword of earlier versions: ``(group, field)``.
LEGACY: Dict[str, Tuple[str, str]] = {
    # Every Tuning field but those added since the groups (``copy_ahead``, ``stream_latches``,
    # ``blocking_sync``).
    **{name: ("tuning", name) for name in TUNING_FIELDS if name not in ("copy_ahead", "stream_latches", "blocking_sync")},
    "remote_keep_last": ("remote", "keep_last"),
    "remote_max_pending": ("remote", "max_pending"),
    "remote_part_size": ("remote", "part_size"),
    "remote_concurrency": ("remote", "concurrency"),
    "remote_request_timeout": ("remote", "request_timeout"),
    "remote_complete_timeout": ("remote", "complete_timeout"),
    "remote_every": ("remote", "every"),
    "node": ("replicas", "node"),
    "replica_group": ("replicas", "group"),
    "replica_bandwidth": ("replicas", "bandwidth"),
    "replica_timeout": ("replicas", "timeout"),
    "node_local_root": ("replicas", "node_local_root"),
    "disk_every": ("cadence", "disk_every"),
    "disk_interval_s": ("cadence", "disk_interval_s"),
    "memory_steps": ("cadence", "memory_steps"),
    "replicate_every": ("replicas", "every"),
}

_CLASSES: Dict[str, Any] = {"tuning": Tuning, "remote": RemoteTier, "replicas": Replicas, "cadence": Cadence}


def unknown_keyword(owner: str, name: str, valid: Iterable[str]) -> TypeError:
    """The ``TypeError`` of keyword ``name`` that ``owner`` does not take, naming the
    closest valid one."""
    valid = list(valid)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return TypeError(f"{owner}() got an unexpected keyword argument {name!r}{hint}")


def _default(group: str, name: str) -> Any:
    for f in fields(_CLASSES[group]):
        if f.name == name:
            return f.default
    raise KeyError(name)  # pragma: no cover - LEGACY names fields of the classes


def apply_legacy(
    owner: str,
    groups: Mapping[str, Any],
    legacy: Mapping[str, Any],
    valid: Iterable[str],
    stacklevel: int = 3,
) -> Dict[str, Any]:
    """The groups of ``owner`` (``groups``: ``"tuning"``, ``"remote"``, ``"replicas"``,
    ``"cadence"`` as given, each a dataclass, a shorthand or ``None``) with the flat
    keywords ``legacy`` of earlier versions folded in, each group then as its dataclass
    or ``None``. A keyword neither flat nor valid is a ``TypeError`` naming the closest
    valid one (``valid`` plus the flat names); each flat keyword used warns once
    (``DeprecationWarning``, naming the new spelling). A flat keyword of a group that was
    given as its dataclass is a ``ConfigError`` (one place for each setting); a tier's
    flat setting without the tier (``remote_keep_last`` without ``remote``) has no effect,
    as before, and warns unless it is the default."""
    valid = list(valid)
    for k in legacy:
        if k not in LEGACY or LEGACY[k][0] not in groups:
            raise unknown_keyword(owner, k, valid + [n for n, (g, _) in LEGACY.items() if g in groups])
    by_group: Dict[str, Dict[str, Any]] = {g: {} for g in groups}
    for k, v in legacy.items():
        g, f = LEGACY[k]
        by_group[g][f] = v
    if legacy:
        spelled = ", ".join(f"{k}= -> {_CLASSES[LEGACY[k][0]].__name__}({LEGACY[k][1]}=...)" for k in legacy)
        warnings.warn(
            f"{owner}: flat keyword arguments are deprecated; use the grouped settings "
            f"(shmckpt.config): {spelled}",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
    out: Dict[str, Any] = {}
    for g, given in groups.items():
        cls = _CLASSES[g]
        extra = by_group[g]
        if isinstance(given, cls):
            if extra:
                flat = next(n for n, (gg, f) in LEGACY.items() if gg == g and f in extra and n in legacy)
                raise ConfigError(
                    f"{flat}= and {g}={cls.__name__}(...) both given: set {cls.__name__}.{LEGACY[flat][1]}"
                )
            out[g] = given
            continue
        if g == "tuning":
            if given is not None:
                raise ConfigError(f"tuning must be a shmckpt.Tuning, not {type(given).__name__}")
            out[g] = Tuning(**extra) if extra else None
        elif g == "remote":
            if given is None:
                _refuse_without(g, "remote", extra, legacy)
                out[g] = None
            elif isinstance(given, str):
                out[g] = RemoteTier(given, **extra)
            else:
                raise ConfigError(
                    f"remote must be an s3:// URL or a shmckpt.RemoteTier, not {type(given).__name__}"
                )
        elif g == "replicas":
            if given is None or (isinstance(given, int) and not isinstance(given, bool)):
                count = int(given or 0)
                if count == 0 and not extra.get("node_local_root", False):
                    _refuse_without(g, "replicas", extra, legacy)
                    out[g] = None
                else:
                    out[g] = Replicas(k=count, **extra)
            else:
                raise ConfigError(f"replicas must be an int or a shmckpt.Replicas, not {type(given).__name__}")
        elif g == "cadence":
            if given is not None:
                raise ConfigError(f"cadence must be a shmckpt.Cadence, not {type(given).__name__}")
            out[g] = Cadence(**extra) if extra else None
    return out


def _refuse_without(group: str, tier: str, extra: Mapping[str, Any], legacy: Mapping[str, Any]) -> None:
    """A flat setting of ``tier`` given without the tier: it has no effect (as in earlier
    versions, which ignored it); said by a warning unless it is the default."""
    for f, v in extra.items():
        d = _default(group, f)
        if v is not d and v != d:
            k = next(n for n, (g, ff) in LEGACY.items() if g == group and ff == f and n in legacy)
            warnings.warn(
                f"{k}={v!r} has no effect: the {tier} tier is off ({tier}=... not given)",
                UserWarning,
                stacklevel=4,
            )


def engine_settings(
    tuning: Optional[Tuning],
    remote: Optional[RemoteTier],
    cadence: Optional[Cadence],
    **more: Any,
) -> Dict[str, Any]:
    """The one dict ``_shmckpt.Engine(root, config)`` takes (its ``EngineSettings``): the
    groups flattened to the engine's keys, plus ``more`` (``rank``, ``keep_last``, ...),
    ``None`` values left out."""
    out: Dict[str, Any] = dict(tuning.given()) if tuning is not None else {}
    if remote is not None:
        out.update(
            remote=remote.url,
            remote_keep_last=remote.keep_last,
            remote_max_pending=remote.max_pending,
            remote_part_size=remote.part_size,
            remote_concurrency=remote.concurrency,
            remote_request_timeout=remote.request_timeout,
            remote_complete_timeout=remote.complete_timeout,
            remote_every=remote.every,
        )
    if cadence is not None:
        out.update(
            disk_every=cadence.disk_every,
            disk_interval_s=cadence.disk_interval_s,
            memory_steps=cadence.memory_steps,
        )
    out.update(more)
    return {k: v for k, v in out.items() if v is not None}


def tuning_of(owner: str, tuning: Optional[Tuning], legacy: Mapping[str, Any], valid: Iterable[str]) -> Tuning:
    """The :class:`Tuning` of an integration (``ShmckptWriter``, the Megatron strategy,
    ``dcp.prepare``, the Lightning plugin): ``tuning`` with the flat tuning keywords of
    earlier versions folded in (:func:`apply_legacy`), never ``None``."""
    got = apply_legacy(owner, {"tuning": tuning}, legacy, valid, stacklevel=4)["tuning"]
    return got if got is not None else Tuning()

