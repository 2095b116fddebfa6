"""Peer replicas: each rank's committed checkpoint file (or memory-only step of a
``Cadence``) held in the shared memory of ranks on other machines, moved over
``torch.distributed`` (``docs/replicas.md``).

The protocol (partner plan, replica names, the checks of every image against the committed
manifest) is the Rust crate's (``shmckpt::replica``); this module is the transport: a
dedicated gloo process group (or the user's) on which every collective is issued in the
same order on every rank: by a background thread that replicates every save in order once
it is committed, and by :meth:`Checkpointer.load` once that thread is idle.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

from . import _shmckpt
from ._replica_load import ReplicaLoads
from ._replica_net import ImagePieces, _GroupFailed
from .errors import ConfigError, ReplicationError, ShmckptError

if TYPE_CHECKING:  # pragma: no cover
    from ._host import CheckpointerLike
    from ._handle import SaveHandle

__all__ = ["Replicator", "node_of", "list_replicas", "remove_replica", "DEFAULT_BANDWIDTH", "DEFAULT_TIMEOUT"]

log = logging.getLogger("shmckpt.replicas")

#: Default ``replica_bandwidth``: bytes per second each rank sends its replicas at, at most
#: (1 GiB/s; ``None``: unbounded).
DEFAULT_BANDWIDTH: Optional[float] = float(1 << 30)
#: Default ``replica_timeout``: seconds a step of the replication exchange waits for a peer.
DEFAULT_TIMEOUT = 300.0


def node_of(rank: int, node: Optional[str] = None) -> str:
    """The machine of ``rank``: ``node`` when given, else the block of ``LOCAL_WORLD_SIZE``
    ranks it falls in (torchrun's numbering), else the host name."""
    if node is not None:
        return f"node:{node}"
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    if lws is not None:
        try:
            n = int(lws)
        except ValueError:
            raise ConfigError(f"LOCAL_WORLD_SIZE={lws!r} is not an integer") from None
        if n <= 0:
            raise ConfigError(f"LOCAL_WORLD_SIZE={lws!r} must be positive")
        return f"block:{rank // n}"
    return f"host:{socket.gethostname()}"


def list_replicas() -> List[Dict[str, Any]]:
    """Every replica in ``/dev/shm``: name, root tag, source rank, step, bytes, owner uid."""
    keys = ("name", "root_tag", "source_rank", "step", "bytes", "owner_uid")
    return [dict(zip(keys, r)) for r in _shmckpt.replica_list()]


def remove_replica(name: str) -> None:
    """Remove this user's replica ``name`` from ``/dev/shm`` (never through a link)."""
    _shmckpt.replica_remove(name)


class Replicator(ReplicaLoads):
    """The replication of one :class:`~shmckpt.Checkpointer` (built by it when
    ``replicas > 0``). Construction is collective over the group."""

    def __init__(
        self,
        ckpt: "CheckpointerLike",
        replicas: int,
        node: Optional[str],
        group: Any,
        bandwidth: Optional[float] = DEFAULT_BANDWIDTH,
        timeout: float = DEFAULT_TIMEOUT,
        node_local: bool = False,
        keep_last: Optional[int] = None,
        replicate_every: int = 1,
        disk_every: Any = 1,
    ):
        import datetime

        import torch.distributed as dist

        if node_local and int(replicas) <= 0:
            raise ConfigError("node_local_root=True needs replicas > 0 (a lost machine's files come from its partners)")
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("replicas > 0 needs torch.distributed initialized")
        if bandwidth is not None and not (float(bandwidth) > 0):
            raise ConfigError(f"replica_bandwidth must be a positive number of bytes per second or None, not {bandwidth!r}")
        if not (float(timeout) > 0):
            raise ConfigError(f"replica_timeout must be a positive number of seconds, not {timeout!r}")
        if isinstance(replicate_every, bool) or not isinstance(replicate_every, int) or replicate_every < 1:
            raise ConfigError(f"replicate_every must be an int >= 1 (1: every save), not {replicate_every!r}")
        if node_local and (disk_every != 1 or replicate_every != 1):
            raise ConfigError(
                "node_local_root=True commits every step through the replication: disk_every and "
                "replicate_every must be 1"
            )
        self._dist = dist
        self.ckpt = ckpt
        self.replicas = int(replicas)
        #: Every ``replicate_every``-th save is replicated, disk or memory-only alike (the
        #: first, then every ``replicate_every``-th after the last replicated one).
        self.replicate_every = int(replicate_every)
        #: Saves since the last replicated one (None before the first): every rank counts
        #: the same saves, each decided from every rank's outcome (`_replicate`).
        self._since_replica: Optional[int] = None
        #: Bytes per second this rank sends replicas at, at most (None: unbounded).
        self.bandwidth: Optional[float] = None if bandwidth is None else float(bandwidth)
        #: Seconds any step of the replication exchange may wait for a peer (the timeout of
        #: the group made here; a ``replica_group`` given keeps its own timeout).
        self.timeout = float(timeout)
        #: Node-local roots: ``ckpt.root`` is this machine's own; steps commit through the group.
        self.node_local = bool(node_local)
        #: The checkpointer's retention: with node-local roots, run by each machine's
        #: committing rank once a step is committed on every machine (after its report).
        self.keep_last = keep_last
        self._retention_due = False
        #: Why replication stopped (the group failed: a rank died or timed out), or None.
        self.broken: Optional[str] = None
        if group is None:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        self.group = group
        if dist.get_world_size(group) != ckpt.world_size or dist.get_rank(group) != ckpt.rank:
            raise ConfigError(
                "replica_group must hold every rank, in the world's order "
                f"(group rank {dist.get_rank(group)} of {dist.get_world_size(group)}, "
                f"checkpointer rank {ckpt.rank} of {ckpt.world_size})"
            )
        self.node = node_of(ckpt.rank, node)
        mine: List[Any] = [None] * ckpt.world_size
        dist.all_gather_object(mine, (self.node, self.bandwidth, int(ckpt.engine.chunk_size)), group=group)
        self.nodes: List[str] = [str(n) for n, _, _ in mine]
        #: Every rank's ``replica_bandwidth`` and staging chunk size (the pieces its images
        #: travel in follow them).
        self.bandwidths: List[Optional[float]] = [None if b is None else float(b) for _, b, _ in mine]
        self.chunk_sizes: List[int] = [int(c) for _, _, c in mine]
        #: ``plan[r]``: the ranks that hold rank r's replicas, in the order loads ask them.
        self.plan: List[List[int]] = [list(p) for p in _shmckpt.replica_plan(self.nodes, self.replicas)]
        self._peer: Optional[int] = None
        #: Replicas sealed by the last step, ``(source, step, keep)``, whose older ones are
        #: removed (but ``keep``'s: a memory-only step's replica keeps the newest committed
        #: step's, which a lost rank can load until the memory-only step is committed).
        self._older: List[Tuple[int, int, Optional[int]]] = []
        #: The size of the last image each source sent (the guess for the next arenas).
        self._last_sizes: Dict[int, int] = {}
        #: The image a partner sent for the step of the last ``before_load`` (``(step,
        #: ReplicaImage)``, sealed: checked and written back), until the load takes it.
        self._image: Optional[Tuple[int, Any]] = None
        #: The image a partner sent to complete the commit of an uncommitted step (issue
        #: 38: ``(step, source rank, ReplicaImage)``, sealed and committed), handed to the
        #: next ``before_load`` of that step.
        self._completed: Optional[Tuple[int, int, Any]] = None
        #: Whether the last load was served from :attr:`_image`.
        self._served_image = False
        #: Seconds the collective part of the last load took (who needs an image, the
        #: transfers, the checks and the write-backs), or None.
        self.last_fetch_seconds: Optional[float] = None
        # The replication thread: it alone uses the group while saves are queued or in
        # replication (`_drain` before any other collective on it).
        self._cv = threading.Condition()
        self._queue: List["SaveHandle"] = []
        self._busy = False
        self._closing = False
        self._results: Dict[int, Any] = {}  # step -> report dict or the exception
        self._thread: Optional[threading.Thread] = None

    def enqueue(self, handle: "SaveHandle") -> None:
        """Replicate ``handle``'s step in the background once it is committed (called by
        :meth:`Checkpointer.save` for every save, so every rank queues the same steps in the
        same order and the thread's collectives match)."""
        with self._cv:
            if self._closing:
                raise ConfigError("the checkpointer is closed")
            self._queue.append(handle)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shmckpt-replicate", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                handle = self._queue.pop(0)
                self._busy = True
            result: Any
            try:
                result = self._replicate_handle(handle)
            except Exception as e:  # handed to wait_replicated(); BaseException propagates
                result = e
            with self._cv:
                self._results[int(handle.step)] = result
                for s in sorted(self._results)[:-16]:
                    del self._results[s]
                self._cv.notify_all()  # wait_replicated() returns now...
            self._remove_older()  # ...and _drain() / close() once this is done too
            self._apply_retention()
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _remove_older(self) -> None:
        """Remove the replicas older than the ones the last step sealed (after its report is
        out: freeing a large replica's pages is not part of the time to k-safe)."""
        older, self._older = self._older, []
        for q, step, keep in older:
            try:
                _shmckpt.replica_remove_older(self.ckpt.root, q, step, keep)
            except ShmckptError as e:
                log.warning("rank %d: could not remove older replicas of rank %d: %s", self.ckpt.rank, q, e)

    def _apply_retention(self) -> None:
        """Node-local roots: retention (``keep_last``) in this machine's root, by the rank
        that committed the step there, once the step is committed on every machine (after
        its report: deleting large files can take seconds). A shared root's retention is
        the engine's, at its commit."""
        if not self._retention_due or self.keep_last is None:
            return
        self._retention_due = False
        try:
            gone = _shmckpt.group_apply_retention(self.ckpt.root, int(self.keep_last))
            if gone:
                log.debug("rank %d: retention removed steps %s from %s", self.ckpt.rank, gone, self.ckpt.root)
        except ShmckptError as e:
            log.warning("rank %d: retention failed in %s; older checkpoints kept: %s", self.ckpt.rank, self.ckpt.root, e)

    def _drain(self) -> None:
        """Wait until the thread has replicated every queued save."""
        with self._cv:
            while self._queue or self._busy:
                self._cv.wait(0.05)

    def close(self) -> None:
        """Finish the queued replications, then stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            t = self._thread
        if t is not None:
            t.join()

    def wait_replicated(self, handle: "SaveHandle") -> Dict[str, Any]:
        """Wait for the background replication of ``handle``'s step (see
        :meth:`_replicate_handle`) and return its report, or raise its error."""
        step = int(handle.step)
        with self._cv:
            while step not in self._results:
                queued = any(int(h.step) == step for h in self._queue)
                if not queued and not self._busy:
                    raise ReplicationError(f"step {step} was not replicated by this checkpointer (or is too old)")
                self._cv.wait(0.05)
            result = self._results[step]
        if isinstance(result, Exception):
            raise result
        return dict(result)

    # -- replication -------------------------------------------------------------------
    def _replicate_handle(self, handle: "SaveHandle") -> Dict[str, Any]:
        """Collective on the group (the replication thread only): wait for ``handle``'s
        step to be committed (or staged, memory-only), send this rank's image to its
        partners, store (checked) the
        images sent to this rank, and return the step's replication report once every
        rank's image is held by ``replicas`` ranks on other machines. Raises
        :class:`~shmckpt.errors.ReplicationError` (on every rank) when some image is not,
        when some rank's save failed, or when the group fails (a rank died: the group is
        then unusable; a hung rank stalls replication until the group's timeout)."""
        step = int(handle.step)
        t0 = time.monotonic()
        ahead = self._prepare(step)
        failure: Optional[str] = None
        held = None
        memory_only = False
        try:
            memory_only = bool(handle.wait().get("memory_only", False))
        except ShmckptError as e:
            failure = f"rank {self.ckpt.rank}: the save of step {step} failed: {e}"
        # The committed image, held in its staging chunks when it was whole in the arena
        # (the engine's replica_hold): sent from there; given back when this step's
        # replication ends, however it ends.
        rust = getattr(handle, "_rust", None)
        if rust is not None:
            held = rust.take_held_image()
        durable = time.monotonic()
        try:
            if self.broken is not None:
                msg = f"step {step} is not replicated (skipped): replication stopped, {self.broken}"
                log.warning("%s", msg)
                raise ReplicationError(msg)
            return self._replicate(
                step, failure, t0, durable, dict(getattr(handle, "_metadata", {})), ahead, held, memory_only
            )
        except _GroupFailed as e:
            # The group cannot be used again (gloo): later steps are skipped, not hung on.
            self.broken = f"since step {step}: {e} (restart the ranks to replicate again)"
            log.warning("rank %d: %s", self.ckpt.rank, self.broken)
            raise ReplicationError(f"step {step} is not {self.replicas}-safe: {e}") from None
        finally:
            ahead.clear()  # arenas not received into are removed
            if held is not None:
                held.close()  # what no piece took goes back to the arena

    def _prepare(self, step: int) -> Dict[int, Any]:
        """Replica arenas for ``step``'s images from this rank's sources, each sized as that
        source's last image, made before the step is committed: allocating an arena's pages
        (a GiB takes a noticeable fraction of a second) then overlaps the save's drain
        instead of delaying the exchange. An arena whose guess was wrong is resized when
        the step is committed; one that cannot be made now is made then."""
        out: Dict[int, Any] = {}
        if self.broken is not None:
            return out
        for q, n in self._last_sizes.items():
            try:
                out[q] = _shmckpt.replica_prepare(self.ckpt.root, step, q, n)
            except ShmckptError as e:
                log.debug("rank %d: no arena made ahead for rank %d's image of step %d: %s", self.ckpt.rank, q, step, e)
        return out

    def _replicate(
        self,
        step: int,
        failure: Optional[str],
        t0: float,
        durable: float,
        metadata: Dict[str, str],
        ahead: Dict[int, Any],
        staged: Optional[Any] = None,
        memory_only: bool = False,
    ) -> Dict[str, Any]:
        """``t0``: when this step's replication started; ``durable``: when this rank's save
        was durable; ``staged``: this rank's image held in staging (a ``HeldImage``), or
        None (then read from the file); ``memory_only``: this rank's save stayed in memory
        (``disk_every``)."""
        # Every rank's file is durable once every rank's wait returned: the step is committed
        # (a shared root), or can be (node-local roots: committed here, through the group).
        outcomes = self._gather((failure, memory_only), "the outcome of every rank's save")
        failures = [f for f, _ in outcomes if f is not None]
        if failures:
            raise ReplicationError(f"step {step} is not replicated: " + "; ".join(failures))
        # Whether the step is replicated: decided alike on every rank, from every rank's
        # outcome (a memory-only step has no committed file to send).
        memory = all(bool(m) for _, m in outcomes)
        skipped = self._skip_reason(step, [bool(m) for _, m in outcomes])
        if skipped is not None:
            return self._skipped(step, skipped, t0, memory)
        if self.node_local:
            self._commit_through_group(step, metadata)
        marks = [("durable", durable), ("committed", time.monotonic())]
        me = self.ckpt.rank
        root = self.ckpt.root
        problem: Optional[str] = None
        image: Optional[ImagePieces] = None
        entries: List[Optional[str]] = []
        if memory:
            # A memory-only step: its image copied out of the staging chunks (the memory
            # tier's lock held for the copy: it cannot be given up mid-copy), every
            # tensor's CRC-32C computed from the copy (in Rust, GIL released); the
            # receivers check the image against that entry.
            entry: Optional[str] = None
            try:
                source, entry = _shmckpt.replica_memory_source(self.ckpt.engine, step)
                image = ImagePieces(source, None, me)
                del source  # the copy lives as long as `image` (freed after the exchange)
            except ShmckptError as e:
                problem = f"rank {me} no longer holds memory-only step {step}: {e}"
                log.info("%s", problem)
            entries = self._gather(entry, "every rank's entry of the memory-only step")
            gone = [r for r, e in enumerate(entries) if e is None]
            if gone:
                # Given up before it was copied (a newer save superseded it): nothing is
                # sent on any rank, never bytes of another step.
                return self._skipped(step, f"memory-only step given up before it was sent (ranks {gone})", t0, True)
            readable = [True] * self.ckpt.world_size
            sizes = {q: int(json.loads(str(e))["bytes"]) for q, e in enumerate(entries)}
        else:
            try:
                # Opened and checked now (no link, size, header); sent piece by piece from
                # the staging chunks held, else read from the file as it is sent (the
                # receiver checks every tensor's CRC-32C before it holds it).
                source = _shmckpt.replica_source(root, step, me)
                if staged is not None and int(staged.nbytes) != int(source.nbytes):
                    staged.close()  # never expected: the held image is the committed file's
                    staged = None
                image = ImagePieces(source, staged, me)
            except ShmckptError as e:
                problem = f"rank {me} cannot read its image of step {step}: {e}"
                log.warning("%s", problem)
            readable = self._gather(image is not None, "who can send its image")
            sizes = self._sizes(step)
        sources = [q for q in range(self.ckpt.world_size) if me in self.plan[q] and readable[q]]
        sends = [(t, image) for t in self.plan[me]] if image is not None else []
        # Each image is received straight into a new replica arena in /dev/shm, published
        # only once `seal()` found it equal to the committed manifest.
        problems: Dict[int, str] = {}
        recvs: List[Tuple[int, Any]] = []
        for q in [q for q in ahead if q not in sources]:
            del ahead[q]  # removed before any arena of the same name is made
        self._last_sizes = {q: sizes[q] for q in sources}
        keep = self._newest_committed(step) if memory else None
        for q in sources:
            try:
                # (No local name holds the arena: one refused must go with `recvs`, its
                # unsealed file removed, even while a raised error keeps this frame.)
                recvs.append(
                    (
                        q,
                        _shmckpt.replica_receive_memory(root, step, q, str(entries[q]), ahead.pop(q, None))
                        if memory
                        else _shmckpt.replica_receive(root, step, q, ahead.pop(q, None)),
                    )
                )
            except ShmckptError as e:
                # The bytes still come (the sender does not know): received and dropped.
                problems[q] = f"rank {me} cannot make a replica arena for rank {q}'s image of step {step}: {e}"
                log.warning("%s", problems[q])
                recvs.append((q, np.empty(sizes[q], dtype=np.uint8)))
        marks.append(("opened", time.monotonic()))
        got, refused, sent, transfer = self._exchange(sends, recvs, paced=True)
        for q, why in refused.items():
            problems.setdefault(q, f"rank {me} refused rank {q}'s image of step {step} before any byte of it came: {why}")
        marks.append(("exchanged", time.monotonic()))
        sent_from = {"staging": 0, "copied": 0, "file": 0} if image is None else dict(image.sent_from)
        if problem is None and image is not None:
            problem = image.problem
        del image, recvs, sends
        held: List[int] = []
        for q in sorted(got):
            arena = got.pop(q)
            if q in problems:
                continue
            try:
                arena.seal(keep_older=True)  # older ones removed after the report (_remove_older)
                held.append(q)
                self._older.append((q, step, keep))
            except ShmckptError as e:
                problems[q] = f"rank {me} refused rank {q}'s image of step {step}: {e}"
                log.warning("%s", problems[q])
            del arena  # an arena that failed its check is gone with it
        marks.append(("checked", time.monotonic()))
        everyone = self._gather((held, problems, problem), "who holds which image")
        marks.append(("agreed", time.monotonic()))
        holders: Dict[int, List[int]] = {q: [] for q in range(self.ckpt.world_size)}
        all_problems: List[str] = []
        for r, (h, probs, p) in enumerate(everyone):
            for q in h:
                holders[q].append(r)
            all_problems.extend(probs.values())
            if p is not None:
                all_problems.append(p)
        k_safe = all(len(v) >= self.replicas for v in holders.values())
        report = {
            "step": step,
            "replicas": self.replicas,
            "replicated": True,
            "skipped": None,
            "memory_only": memory,
            "holders": holders,
            "k_safe": k_safe,
            "seconds": time.monotonic() - t0,
            "bytes_sent": sent,
            # Where the bytes sent came from: the staging chunks held (zero-copy), copies
            # of held chunks that were not consecutive, the committed file (not held, or
            # given back under staging pressure).
            "sent_from": sent_from,
            "transfer_seconds": transfer,
            "bandwidth": self.bandwidth,
            "problems": all_problems,
            # Seconds from the start of this step's replication to the end of each phase:
            # this rank's save durable, every rank's outcome known (and node-local roots
            # committed), its image opened and the arenas made, the exchange, the received
            # images checked and published, every rank's holdings known.
            "phases": {name: at - t0 for name, at in marks},
        }
        if not k_safe:
            short = {q: v for q, v in holders.items() if len(v) < self.replicas}
            raise ReplicationError(
                f"step {step} is not {self.replicas}-safe: held by {short}; " + "; ".join(all_problems)
            )
        return report

    def _skip_reason(self, step: int, memory_only: List[bool]) -> Optional[str]:
        """Why ``step`` is not replicated, or None when it is (and it is counted): not the
        ``replicate_every``-th save (every save counts, disk or memory-only). Ranks that
        disagree on the disk (never with ``disk_every=N``) raise
        :class:`~shmckpt.errors.ReplicationError`."""
        if any(memory_only) and not all(memory_only):
            ranks = [r for r, m in enumerate(memory_only) if m]
            raise ReplicationError(f"step {step} is not replicated: memory-only on ranks {ranks} only")
        since = self._since_replica
        if since is None or since + 1 >= self.replicate_every:
            self._since_replica = 0
            return None
        self._since_replica = since + 1
        return f"replicate_every={self.replicate_every}"

    def _skipped(self, step: int, why: str, t0: float, memory: bool) -> Dict[str, Any]:
        """The report of ``step`` not replicated, and why (decided alike on every rank)."""
        log.debug("rank %d: step %d not replicated: %s", self.ckpt.rank, step, why)
        return {
            "step": step,
            "replicas": self.replicas,
            "replicated": False,
            "skipped": why,
            "memory_only": memory,
            "holders": {},
            "k_safe": False,
            "seconds": time.monotonic() - t0,
            "bytes_sent": 0,
            "sent_from": {"staging": 0, "copied": 0, "file": 0},
            "transfer_seconds": 0.0,
            "bandwidth": self.bandwidth,
            "problems": [],
            "phases": {},
        }

    def _newest_committed(self, step: int) -> Optional[int]:
        """The newest step committed in this root before ``step``, or None: its replicas
        stay when a memory-only ``step``'s are stored."""
        older = [int(s) for s, _ in self.ckpt.engine.list() if int(s) < step]
        return max(older) if older else None

    def _commit_through_group(self, step: int, metadata: Dict[str, str]) -> None:
        """Node-local roots: every rank's file of ``step`` is durable on its machine; the
        ranks gather every manifest part, and the lowest rank of each machine commits its
        root with all of them (``shmckpt::commit::commit_with_parts``: the one commit
        protocol). :class:`~shmckpt.errors.ReplicationError` on every rank when a part is
        missing or some machine could not commit."""
        me = self.ckpt.rank
        part: Optional[bytes] = None
        problem: Optional[str] = None
        try:
            part = bytes(_shmckpt.group_own_part(self.ckpt.root, step, me))
        except ShmckptError as e:
            problem = f"rank {me} has no manifest part of step {step}: {e}"
        parts = self._gather((part, problem), "every rank's manifest part")
        missing = [p for _, p in parts if p is not None]
        if missing:
            raise ReplicationError(f"step {step} is not committed: " + "; ".join(missing))
        committer = self._leads_machine()
        err: Optional[str] = None
        if committer:
            try:
                _shmckpt.group_commit(self.ckpt.root, step, me, [p for p, _ in parts], metadata)
            except ShmckptError as e:
                err = f"rank {me} could not commit step {step} in its machine's root {self.ckpt.root}: {e}"
                log.warning("%s", err)
        errs = [e for e in self._gather(err, "every machine's commit") if e is not None]
        if errs:
            raise ReplicationError(f"step {step} is not committed on every machine: " + "; ".join(errs))
        self._retention_due = committer
