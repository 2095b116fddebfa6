"""Peer replicas: each rank's committed checkpoint file held in the shared memory of ranks
on other machines, moved over ``torch.distributed`` (``docs/replicas.md``).

The protocol (partner plan, replica names, the checks of every image against the committed
manifest) is the Rust crate's (``shmckpt::replica``); this module is the transport: a
dedicated gloo process group (or the user's) on which every collective is issued in the
same order on every rank: by a background thread that replicates every save in order once
it is committed, and by :meth:`Checkpointer.load` once that thread is idle.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _shmckpt
from .errors import ConfigError, ReplicationError, ShmckptError

if TYPE_CHECKING:  # pragma: no cover
    from .checkpointer import Checkpointer, SaveHandle

__all__ = ["Replicator", "node_of", "list_replicas", "remove_replica", "DEFAULT_BANDWIDTH", "DEFAULT_TIMEOUT"]

log = logging.getLogger("shmckpt.replicas")

#: Default ``replica_bandwidth``: bytes per second each rank sends its replicas at, at most
#: (1 GiB/s; ``None``: unbounded).
DEFAULT_BANDWIDTH: Optional[float] = float(1 << 30)
#: Default ``replica_timeout``: seconds a step of the replication exchange waits for a peer.
DEFAULT_TIMEOUT = 300.0
#: Pacing: a paced send is cut in pieces of this many seconds of the bandwidth...
_PACE_SECONDS = 0.05
#: ...of at least this many bytes and at most this many (unbounded: the largest).
_PIECE_MIN = 64 << 10
_PIECE_MAX = 64 << 20


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


class _GroupFailed(Exception):
    """The replication group failed (internal: turned into
    :class:`~shmckpt.errors.ReplicationError`, and replication stops)."""

    def __init__(self, message: str, peers: Sequence[int] = ()):
        super().__init__(message)
        self.peers = list(peers)


class Replicator:
    """The replication of one :class:`~shmckpt.Checkpointer` (built by it when
    ``replicas > 0``). Construction is collective over the group."""

    def __init__(
        self,
        ckpt: "Checkpointer",
        replicas: int,
        node: Optional[str],
        group: Any,
        bandwidth: Optional[float] = DEFAULT_BANDWIDTH,
        timeout: float = DEFAULT_TIMEOUT,
        node_local: bool = False,
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
        self._dist = dist
        self.ckpt = ckpt
        self.replicas = int(replicas)
        #: Bytes per second this rank sends replicas at, at most (None: unbounded).
        self.bandwidth: Optional[float] = None if bandwidth is None else float(bandwidth)
        #: Seconds any step of the replication exchange may wait for a peer (the timeout of
        #: the group made here; a ``replica_group`` given keeps its own timeout).
        self.timeout = float(timeout)
        #: Node-local roots: ``ckpt.root`` is this machine's own; steps commit through the group.
        self.node_local = bool(node_local)
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
        dist.all_gather_object(mine, (self.node, self.bandwidth), group=group)
        self.nodes: List[str] = [str(n) for n, _ in mine]
        #: Every rank's ``replica_bandwidth`` (the pieces its images travel in follow it).
        self.bandwidths: List[Optional[float]] = [None if b is None else float(b) for _, b in mine]
        #: ``plan[r]``: the ranks that hold rank r's replicas, in the order loads ask them.
        self.plan: List[List[int]] = [list(p) for p in _shmckpt.replica_plan(self.nodes, self.replicas)]
        self._peer: Optional[int] = None
        #: Why this rank's image could not be read while it was sent (the current step).
        self._send_problem: Optional[str] = None
        #: The image a partner sent for the step of the last ``before_load`` (``(step,
        #: ReplicaImage)``, sealed: checked and written back), until the load takes it.
        self._image: Optional[Tuple[int, Any]] = None
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

    # -- helpers -----------------------------------------------------------------------
    def _gather(self, obj: Any, what: str) -> List[Any]:
        out: List[Any] = [None] * self.ckpt.world_size
        try:
            self._dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:  # torch.distributed: a rank died, or the group timed out
            raise _GroupFailed(
                f"the replication group failed while gathering {what} (a rank died, or was "
                f"silent for more than the group's timeout, {self.timeout:g} s by default): {e}"
            ) from e
        return out

    def _sizes(self, step: int) -> Dict[int, int]:
        m = self.ckpt.manifest(step)
        return {int(f["rank"]): int(f["bytes"]) for f in m["files"]}

    def _pieces(self, n: int, sender: int) -> List[Tuple[int, int]]:
        """The ``(start, end)`` pieces an image of ``n`` bytes from ``sender`` travels in
        (from the sender's bandwidth setting, which every rank knows: both ends cut alike)."""
        bw = self.bandwidths[sender]
        size = _PIECE_MAX if bw is None else max(_PIECE_MIN, min(_PIECE_MAX, int(bw * _PACE_SECONDS)))
        return [(a, min(n, a + size)) for a in range(0, n, size)] or [(0, 0)]

    def _exchange(
        self, sends: Sequence[Tuple[int, Any]], recvs: Sequence[Tuple[int, Any]], paced: bool
    ) -> Tuple[Dict[int, Any], int, float]:
        """Send each ``(dst, buffer)`` and receive each ``(src, buffer)`` (buffers: objects
        numpy views without a copy, ``__array_interface__``: a ``ReplicaImage`` or a
        ``Buffer``, the received ones writable; receives posted first, then the sends,
        piece by piece, one destination after the other in turn, no faster than
        :attr:`bandwidth` when ``paced``); returns the receive buffers by source (filled),
        the bytes sent and the seconds the exchange took. A transfer that fails (the peer
        died, or was silent for the group's timeout) raises :class:`_GroupFailed` naming
        the peers, once every other transfer has finished or failed."""
        import torch

        dist = self._dist
        me = self.ckpt.rank
        t0 = time.monotonic()
        works: List[Tuple[int, str, Any]] = []
        # Received pieces of a restore's image, in order: written to its file as they
        # arrive (`write_through`), so the write-back overlaps the transfer.
        through: Dict[int, Tuple[Any, int]] = {}
        failed: Dict[int, str] = {}
        got: Dict[int, Any] = {}
        views = []
        for src, buf in recvs:
            t = torch.from_numpy(np.asarray(buf))
            views.append(t)
            got[src] = buf
            for a, b in self._pieces(t.numel(), src):
                try:
                    w = dist.irecv(t[a:b], src=src, group=self.group)
                    if getattr(buf, "restore", False):
                        through[id(w)] = (buf, b)
                    works.append((src, "receiving from", w))
                except RuntimeError as e:
                    failed.setdefault(src, f"receiving from rank {src}: {e}")
        with warnings.catch_warnings():  # read-only memory: only ever sent from
            warnings.simplefilter("ignore", UserWarning)
            keep = [(dst, buf, torch.from_numpy(np.asarray(buf))) for dst, buf in sends]
        todo = [(dst, buf, t, self._pieces(t.numel(), me)) for dst, buf, t in keep]
        sent = 0
        bw = self.bandwidth if paced else None
        while any(p for _, _, _, p in todo):
            for dst, buf, t, pieces in todo:
                if not pieces:
                    continue
                a, b = pieces.pop(0)
                if dst in failed:
                    continue
                read_to = getattr(buf, "read_to", None)
                if read_to is not None and self._send_problem is None:
                    # A ReplicaSource: read the file up to this piece while the pieces
                    # before it travel. A failed read sends the rest unread (zeros): the
                    # receiver's check refuses it, and the problem is reported.
                    try:
                        read_to(b)
                    except ShmckptError as e:
                        self._send_problem = f"rank {me} could not read its image: {e}"
                        log.warning("%s", self._send_problem)
                if bw is not None:
                    ahead = t0 + sent / bw - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
                try:
                    works.append((dst, "sending to", dist.isend(t[a:b], dst=dst, group=self.group)))
                except RuntimeError as e:
                    failed.setdefault(dst, f"sending to rank {dst}: {e}")
                sent += b - a
        for peer, what, w in works:
            try:
                w.wait()
            except RuntimeError as e:
                failed.setdefault(peer, f"{what} rank {peer}: {e}")
            hook = through.pop(id(w), None)
            if hook is not None and peer not in failed:
                try:
                    hook[0].write_through(hook[1])
                except ShmckptError as e:  # seal() writes what is left, or fails
                    log.warning("rank %d: writing the image from rank %d early failed: %s", me, peer, e)
                    through = {k: v for k, v in through.items() if v[0] is not hook[0]}
        del keep, views
        if failed:
            got.clear()
            peers = ", ".join(f"rank {p}" for p in sorted(failed))
            raise _GroupFailed(
                f"the transfer with partner {peers} failed (it died, or was silent for more "
                f"than the group's timeout, {self.timeout:g} s by default): " + "; ".join(failed.values()),
                peers=sorted(failed),
            )
        return got, sent, time.monotonic() - t0

    # -- the replication thread --------------------------------------------------------
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
                self._busy = False
                self._cv.notify_all()

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
        step to be committed, send this rank's image to its partners, store (checked) the
        images sent to this rank, and return the step's replication report once every
        rank's image is held by ``replicas`` ranks on other machines. Raises
        :class:`~shmckpt.errors.ReplicationError` (on every rank) when some image is not,
        when some rank's save failed, or when the group fails (a rank died: the group is
        then unusable; a hung rank stalls replication until the group's timeout)."""
        step = int(handle.step)
        t0 = time.monotonic()
        failure: Optional[str] = None
        try:
            handle.wait()
        except ShmckptError as e:
            failure = f"rank {self.ckpt.rank}: the save of step {step} failed: {e}"
        if self.broken is not None:
            msg = f"step {step} is not replicated (skipped): replication stopped, {self.broken}"
            log.warning("%s", msg)
            raise ReplicationError(msg)
        try:
            return self._replicate(step, failure, t0, dict(getattr(handle, "_metadata", {})))
        except _GroupFailed as e:
            # The group cannot be used again (gloo): later steps are skipped, not hung on.
            self.broken = f"since step {step}: {e} (restart the ranks to replicate again)"
            log.warning("rank %d: %s", self.ckpt.rank, self.broken)
            raise ReplicationError(f"step {step} is not {self.replicas}-safe: {e}") from None

    def _replicate(self, step: int, failure: Optional[str], t0: float, metadata: Dict[str, str]) -> Dict[str, Any]:
        # Every rank's file is durable once every rank's wait returned: the step is committed
        # (a shared root), or can be (node-local roots: committed here, through the group).
        failures = [f for f in self._gather(failure, "the outcome of every rank's save") if f is not None]
        if failures:
            raise ReplicationError(f"step {step} is not replicated: " + "; ".join(failures))
        if self.node_local:
            self._commit_through_group(step, metadata)
        me = self.ckpt.rank
        root = self.ckpt.root
        problem: Optional[str] = None
        image = None
        self._send_problem = None
        try:
            # Opened and checked now (no link, size, header); read piece by piece as it is
            # sent (the receiver checks every tensor's CRC-32C before it holds it).
            image = _shmckpt.replica_source(root, step, me)
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
        for q in sources:
            try:
                recvs.append((q, _shmckpt.replica_receive(root, step, q)))
            except ShmckptError as e:
                # The bytes still come (the sender does not know): received and dropped.
                problems[q] = f"rank {me} cannot make a replica arena for rank {q}'s image of step {step}: {e}"
                log.warning("%s", problems[q])
                recvs.append((q, np.empty(sizes[q], dtype=np.uint8)))
        got, sent, transfer = self._exchange(sends, recvs, paced=True)
        del image, recvs
        held: List[int] = []
        for q in sorted(got):
            arena = got.pop(q)
            if q in problems:
                continue
            try:
                arena.seal()
                held.append(q)
            except ShmckptError as e:
                problems[q] = f"rank {me} refused rank {q}'s image of step {step}: {e}"
                log.warning("%s", problems[q])
            del arena  # an arena that failed its check is gone with it
        if problem is None and self._send_problem is not None:
            problem = self._send_problem
        everyone = self._gather((held, problems, problem), "who holds which image")
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
            "holders": holders,
            "k_safe": k_safe,
            "seconds": time.monotonic() - t0,
            "bytes_sent": sent,
            "transfer_seconds": transfer,
            "bandwidth": self.bandwidth,
            "problems": all_problems,
        }
        if not k_safe:
            short = {q: v for q, v in holders.items() if len(v) < self.replicas}
            raise ReplicationError(
                f"step {step} is not {self.replicas}-safe: held by {short}; " + "; ".join(all_problems)
            )
        return report

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
        committer = me == min(r for r, n in enumerate(self.nodes) if n == self.node)
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

    # -- load --------------------------------------------------------------------------
    def agree_step(self, sel: Optional[int]) -> None:
        """Collective before a load with node-local roots (nothing otherwise): the ranks
        agree on the step (``sel``, or the newest any machine committed), and each rank
        whose root lacks that step's manifest (its machine was replaced) adopts a peer's
        (``shmckpt::commit::adopt_manifest``: checked, published as ``step-N/`` holding
        the manifest; the rank's file then comes from its partner's replica)."""
        if not self.node_local:
            return
        self._drain()
        if self.broken is not None:
            return  # no collective on a failed group: each rank loads what its root holds
        try:
            self._agree_step(sel)
        except _GroupFailed as e:
            self.broken = f"in a load: {e} (restart the ranks to replicate again)"
            raise ReplicationError(f"load: {e}") from None

    def _agree_step(self, sel: Optional[int]) -> None:
        me = self.ckpt.rank
        mine = sel if sel is not None else self.ckpt.latest()
        have = mine is not None and os.path.isfile(os.path.join(self.ckpt.root, f"step-{mine}", "manifest.json"))
        seen = self._gather((mine, have), "the step every rank has")
        steps = [s for s, _ in seen if s is not None]
        if sel is not None and any(s != sel for s, _ in seen):
            raise ReplicationError(f"the ranks load different steps: {[s for s, _ in seen]}")
        if not steps:
            return
        target = max(steps)
        holders = [r for r, (s, h) in enumerate(seen) if s == target and h]
        if len(holders) == len(seen):
            return
        if not holders:
            raise ReplicationError(f"no rank's root holds the manifest of step {target}")
        src = holders[0]
        obj: List[Any] = [str(self.ckpt._engine.manifest(target)).encode() if me == src else None]
        try:
            self._dist.broadcast_object_list(obj, src=src, group=self.group)
        except RuntimeError as e:
            raise _GroupFailed(f"the replication group failed while sending the manifest of step {target}: {e}") from e
        # One rank per machine (its lowest) adopts it: the machine's ranks share its root.
        err: Optional[str] = None
        if me not in holders and me == min(r for r, n in enumerate(self.nodes) if n == self.node):
            try:
                _shmckpt.group_adopt_manifest(self.ckpt.root, target, obj[0])
                log.info("rank %d: adopted rank %d's manifest of step %d", me, src, target)
            except ShmckptError as e:
                err = f"rank {me} could not adopt rank {src}'s manifest of step {target} in {self.ckpt.root}: {e}"
                log.warning("%s", err)
        errs = [e for e in self._gather(err, "every machine's adoption of the manifest") if e is not None]
        if errs:
            raise ReplicationError("; ".join(errs))

    def _local_ok(self, step: int) -> bool:
        """Whether this rank's own file of ``step`` is there: a regular file (not followed
        through a link) of the manifest's size. The load checks every byte of it."""
        try:
            _, entry = self.ckpt._rank_entry(step)
        except ShmckptError:
            return False
        path = os.path.join(self.ckpt.root, f"step-{step}", entry["file"])
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == int(entry["bytes"])

    def before_load(self, step: int) -> None:
        """Collective, before a load of ``step``: ranks whose own file of the step is
        missing (or of the wrong size) get their image from a partner that holds a replica
        that passes every check; it is checked again on arrival and written back as the
        rank's file, which the load then reads (checked in full). A rank that needs one and
        that no partner can serve gets :class:`~shmckpt.errors.ReplicationError` (after every collective, so
        the other ranks load on); the others load as without replicas. A failure of the
        group (a rank died) is a :class:`~shmckpt.errors.ReplicationError`."""
        self._peer = None
        self._image = None
        self._served_image = False
        self._drain()
        if self.broken is not None:
            # No collective on a failed group: a rank with its own file loads it; one
            # without raises (no partner can be asked).
            if self._local_ok(step):
                log.warning("rank %d: load of step %d without peers: replication stopped, %s", self.ckpt.rank, step, self.broken)
                return
            raise ReplicationError(
                f"rank {self.ckpt.rank}: its file of step {step} is missing or of the wrong size, and "
                f"no partner can be asked: replication stopped, {self.broken}"
            )
        t0 = time.monotonic()
        try:
            self._before_load(step)
            self.last_fetch_seconds = time.monotonic() - t0
        except _GroupFailed as e:
            self.broken = f"in the load of step {step}: {e} (restart the ranks to replicate again)"
            raise ReplicationError(f"load of step {step}: {e}") from None

    def _before_load(self, step: int) -> None:
        me = self.ckpt.rank
        root = self.ckpt.root
        steps = self._gather(step, "the step every rank loads")
        if len(set(steps)) != 1:
            raise ReplicationError(f"the ranks load different steps: {steps}")
        needs = self._gather(not self._local_ok(step), "who needs a replica")
        needy = [q for q, n in enumerate(needs) if n]
        if not needy:
            return
        can: Dict[int, Any] = {}
        for q in needy:
            if q == me or me not in self.plan[q]:
                continue
            try:
                can[q] = _shmckpt.replica_serve(root, step, q)  # mapped read-only, checked in place
            except ShmckptError as e:
                log.warning("replica of rank %d, step %d not served: %s", q, step, e)
        offers = self._gather(sorted(can), "who can serve a replica")
        server: Dict[int, int] = {}
        for q in needy:
            for r in self.plan[q]:
                if q in offers[r]:
                    server[q] = r
                    break
        sends = [(q, buf) for q, buf in can.items() if server.get(q) == me]
        recvs: List[Tuple[int, Any]] = []
        why = "no partner holds a replica of it that passes the checks"
        dropped = False
        if me in server:
            # Received straight into private memory; `seal()` checks it and writes the
            # rank's file back from it (in Rust, GIL released), and the load then serves
            # the tensors from that memory.
            try:
                recvs.append((server[me], _shmckpt.replica_receive_restore(root, step, me)))
            except ShmckptError as e:
                why = f"no memory to receive its image from rank {server[me]}: {e}"
                log.warning("rank %d: %s", me, why)
                dropped = True
                recvs.append((server[me], np.empty(self._sizes(step)[me], dtype=np.uint8)))
        got, _, _ = self._exchange(sends, recvs, paced=False)
        can.clear()
        del recvs
        for src, img in got.items():
            if dropped:
                continue
            try:
                img.seal()
                self._peer = src
                self._image = (step, img)
                log.info("rank %d: step %d restored from rank %d's replica", me, step, src)
            except ShmckptError as e:
                why = f"the image rank {src} sent was refused: {e}"
                log.warning("rank %d: %s", me, why)
        got.clear()
        if me in needy and self._peer is None:
            _, entry = self.ckpt._rank_entry(step)
            path = os.path.join(root, f"step-{step}", entry["file"])
            raise ReplicationError(
                f"rank {me}: its file of step {step} ({path}) is missing or of the wrong size and {why}"
            )

    def take_image(self, step: int) -> Optional[Any]:
        """The sealed image a partner sent for ``step`` in the last :meth:`before_load` (a
        ``ReplicaImage``: checked against the manifest, written back as this rank's file,
        now private memory the load may serve tensors from), or None; given once."""
        img, self._image = self._image, None
        if img is None or img[0] != step:
            return None
        self._served_image = True
        return img[1]

    def discard_image(self) -> None:
        """Free the image of the last :meth:`before_load` (``load_into`` fills the caller's
        tensors from the written-back file instead)."""
        self._image = None

    def source(self, engine_source: Optional[Tuple[str, Any]]) -> Optional[Tuple[str, Any]]:
        """``("peer", rank)`` when the last load was served from the image a partner sent,
        or it (or ``load_into``, which sets no source of its own) read the file a partner's
        replica restored."""
        if self._peer is not None and (self._served_image or engine_source is None or engine_source[0] == "disk"):
            return ("peer", self._peer)
        return engine_source
