"""The load side of :mod:`shmckpt.replicas`: the collective before a load that agrees on
the step and fetches a lost rank's image from its partners (a mixin of
:class:`~shmckpt.replicas.Replicator`, which holds the state named below)."""

from __future__ import annotations

import logging
import os
import stat
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import _shmckpt
from ._replica_net import ReplicaNet, _GroupFailed
from .errors import CorruptError, IoError, ReplicationError, ShmckptError

log = logging.getLogger("shmckpt.replicas")


class ReplicaLoads(ReplicaNet):
    """What :meth:`Checkpointer.load` asks of the replication (see
    :class:`~shmckpt.replicas.Replicator`)."""

    replicas: int
    node: str
    nodes: List[str]
    node_local: bool
    plan: List[List[int]]
    broken: Optional[str]
    _peer: Optional[int]
    _image: Optional[Tuple[int, Any]]
    _completed: Optional[Tuple[int, int, Any]]
    _served_image: bool
    last_fetch_seconds: Optional[float]

    def _drain(self) -> None:  # pragma: no cover - Replicator's
        raise NotImplementedError

    # -- load --------------------------------------------------------------------------
    def agree_step(self, sel: Optional[int], bucket: bool = True) -> Optional[int]:
        """Collective before a load: the step every rank loads, ``sel`` when given. For
        "latest" (``None``) it is the newest step that every rank can load: from its own
        file (present, of the manifest's size), from a partner's replica, or (``bucket``)
        from the bucket. A newer step some rank cannot get (its machine was lost before
        that step's replicas were stored) is passed over, with a warning naming it and
        those ranks; with no step every rank can load, the newest step (whose load then
        fails on those ranks, with the reason). Node-local roots: each rank whose root
        lacks that step's manifest (its machine was replaced) then adopts a peer's
        (``shmckpt::commit::adopt_manifest``: checked, published as ``step-N/`` holding the
        manifest; the rank's file then comes from its partner's replica). A failed group
        chooses nothing (``sel``): each rank loads what its root holds."""
        self._drain()
        if self.broken is not None:
            return sel  # no collective on a failed group
        try:
            target = sel if sel is not None else self._loadable_latest(bucket)
            if self.node_local:
                self._agree_step(target)
        except _GroupFailed as e:
            self.broken = f"in a load: {e} (restart the ranks to replicate again)"
            raise ReplicationError(f"load: {e}") from None
        return target

    def _memory_steps(self) -> List[int]:
        """The memory-only steps this rank's engine holds (``disk_every``): loadable by this
        rank alone, from its staging memory."""
        return [int(s) for s, tiers in self.ckpt.engine.list_in("local") if "memory" in tiers and "disk" not in tiers]

    def _loadable_latest(self, bucket: bool) -> Optional[int]:
        """The newest step every rank can load (see :meth:`agree_step`). Collective. A
        memory-only step (``disk_every``) counts as this rank's own while its engine holds
        it; one newer than the step chosen is given up (its number can be saved again).

        A step not committed whose partial directory holds the parts of some ranks
        (recovered from their arenas after every trainer died) and whose other ranks'
        images are held by their partners as replicas of the memory-only step (each with
        its sender's entry) is completed first (:meth:`_complete`): the lost ranks' files
        and parts written, the step committed with the one commit protocol. A step that
        cannot be completed is passed over; the replicas of uncommitted steps newer than
        the step chosen are removed (their numbers are saved again)."""
        disk = [s for s, _ in self.ckpt.engine.list()]
        memory = self._memory_steps()
        committed = set(disk)
        parts = [] if self.node_local else self._pending_parts(committed)
        have = sorted(set(disk) | set(memory))
        own = [s for s in disk if self._local_ok(s)] + memory
        tag = _shmckpt.replica_tag(self.ckpt.root)
        uid = os.geteuid()
        ours = [
            (src, step) for _, t, src, step, _, owner in _shmckpt.replica_list() if t == tag and owner == uid
        ]
        # A replica of a memory-only step counts once its step is committed (checked
        # against that manifest when served); one of a step not committed counts to
        # complete that step's commit, with the entry kept beside it.
        held = [(src, step) for src, step in ours if step in committed]
        pending: List[Tuple[int, int]] = []
        if not self.node_local:
            for src, step in ours:
                if step in committed:
                    continue
                try:
                    _shmckpt.replica_memory_entry(self.ckpt.root, step, src)
                    pending.append((src, step))
                except ShmckptError as e:
                    log.info("rank %d: replica of rank %d, step %d cannot complete its commit: %s", self.ckpt.rank, src, step, e)
        remote = self._bucket_steps() if bucket else []
        seen = self._gather((have, own, held, remote, parts, pending, disk), "the steps every rank can load")
        # The rule is the crate's (shmckpt::replica::agree), evaluated by every rank on the
        # same gathered views: the same step everywhere without another exchange.
        candidates, newest = _shmckpt.replica_latest(seen, self.plan)
        skipped: List[str] = []
        for s, kind, servers, short in candidates:
            if kind == "short":
                skipped.append(f"step {s}: ranks {short} have neither their file nor a replica of it")
                continue
            if kind == "complete":
                why = self._complete(s, dict(servers))
                if why is not None:
                    skipped.append(f"step {s}: not committed, and its commit could not be completed: {why}")
                    continue
            if skipped:
                log.warning(
                    "rank %d: loading step %d, the newest step every rank can load (%s)",
                    self.ckpt.rank,
                    s,
                    "; ".join(skipped),
                )
                self._set_aside([x for x in disk if x > s])
            self._give_up_memory([x for x in memory if x > s])
            self._drop_pending([(src, x) for src, x in pending if x > s])
            return int(s)
        # (A step no rank has but as a part of an uncommitted save is never loaded.)
        return newest

    def _pending_parts(self, committed: Any) -> List[int]:
        """The steps not committed whose partial directory holds this rank's durable part
        and the file it names (``_shmckpt.pending_steps``): a save recovered from this
        rank's arena after its trainer died, awaiting the other ranks' parts."""
        try:
            steps = _shmckpt.pending_steps(self.ckpt.root, self.ckpt.rank)
        except ShmckptError as e:
            log.info("rank %d: no pending parts read: %s", self.ckpt.rank, e)
            return []
        return [s for s in steps if s not in committed]

    def _drop_pending(self, replicas: List[Tuple[int, int]]) -> None:
        """Remove this rank's replicas ``(source, step)`` of steps not committed that are
        newer than the step every rank loads: their numbers are saved again, and a replica
        of an earlier save of that number must never complete the later one's commit."""
        for src, step in replicas:
            try:
                _shmckpt.replica_remove(_shmckpt.replica_name(self.ckpt.root, src, step))
                log.warning("rank %d: replica of rank %d's uncommitted step %d, passed over, removed", self.ckpt.rank, src, step)
            except ShmckptError as e:
                log.warning("rank %d: replica of rank %d, step %d could not be removed: %s", self.ckpt.rank, src, step, e)

    def _complete(self, step: int, servers: Dict[int, int]) -> Optional[str]:
        """Complete the commit of the uncommitted ``step`` (collective): each rank ``q`` in
        ``servers`` gets its image from rank ``servers[q]``'s replica of the memory-only
        step, served checked against the entry kept beside it, which travels with the
        offer. The rank checks the image against that entry and its header's step, rank
        and world size, writes it durably as its file in ``step-N.partial``
        (``replica_receive_pending``, ``seal``); once every such rank has, each writes its
        part and the step is committed with the one commit protocol
        (``commit_pending``). Returns None once the step is committed on every rank, else
        why not (then no rank's file or part written here is left)."""
        me = self.ckpt.rank
        root = self.ckpt.root
        can: Dict[int, Any] = {}
        entries: Dict[int, str] = {}
        for q, r in servers.items():
            if r != me:
                continue
            try:
                can[q] = _shmckpt.replica_serve_memory(root, step, q)  # checked in place
                entries[q] = _shmckpt.replica_memory_entry(root, step, q)
            except ShmckptError as e:
                can.pop(q, None)
                log.warning("rank %d: replica of rank %d, step %d not served: %s", me, q, step, e)
        offers = self._gather(entries, "the entries of the replicas that complete the step")
        missing = [q for q, r in servers.items() if not isinstance(offers[r], dict) or not isinstance(offers[r].get(q), str)]
        if missing:
            return f"no partner could serve ranks {missing} a replica that passes the checks"
        recvs: List[Tuple[int, Any]] = []
        err: Optional[str] = None
        if me in servers:
            try:
                img = _shmckpt.replica_receive_pending(root, step, me, self.ckpt.world_size, offers[servers[me]][me])
                recvs.append((servers[me], img))
                del img
            except ShmckptError as e:
                # No receive posted: the agreement refuses the sender's image on both ends.
                err = f"rank {me} cannot receive its image from rank {servers[me]}: {e}"
        got, refused, _, _ = self._exchange(list(can.items()), recvs, paced=False)
        can.clear()
        del recvs
        mine: Optional[Any] = None
        if me in servers and err is None:
            src = servers[me]
            if src in refused:
                err = f"rank {me} refused rank {src}'s image before any byte of it came: {refused[src]}"
            else:
                try:
                    got[src].seal()  # checked, written durably into step-N.partial
                    mine = got[src]
                except ShmckptError as e:
                    err = f"rank {me} refused the image rank {src} sent: {e}"
        got.clear()
        if err is not None:
            log.warning("rank %d: step %d: %s", me, step, err)
        errs = [e for e in self._gather(err, "who wrote its file of the step") if e is not None]
        if errs:
            if mine is not None:
                mine.withdraw_pending()
            return "; ".join(errs)
        # Every lost rank's file is durable: the parts, and the commit.
        cerr: Optional[str] = None
        if mine is not None:
            try:
                mine.commit_pending()
            except ShmckptError as e:
                cerr = f"rank {me} could not commit its part: {e}"
                log.warning("rank %d: step %d: %s", me, step, cerr)
        cerrs = [c for c in self._gather(cerr, "every lost rank's part of the step") if c is not None]
        # Every part written (the rank that found them all merged them): committed now.
        done = os.path.isfile(os.path.join(root, f"step-{step}", "manifest.json"))
        if all(self._gather(done, "whether the step is committed")):
            if mine is not None:
                self._completed = (step, servers[me], mine)
            log.warning(
                "rank %d: step %d, not committed, completed: ranks %s from their partners' replicas",
                me,
                step,
                sorted(servers),
            )
            return None
        if mine is not None:
            mine.withdraw_pending()
        return "; ".join(cerrs) or "the step is not committed on every rank"

    def _give_up_memory(self, steps: List[int]) -> None:
        """Give up this rank's memory-only ``steps`` (newer than the step every rank
        loads: the resumed run saves their numbers again)."""
        for s in steps:
            try:
                self.ckpt.engine.remove(s)
                log.warning("rank %d: memory-only step %d, which some rank cannot load, given up", self.ckpt.rank, s)
            except ShmckptError as e:
                log.warning("rank %d: memory-only step %d could not be given up: %s", self.ckpt.rank, s, e)

    def _set_aside(self, steps: List[int]) -> None:
        """Set the committed ``steps`` this root holds aside (``shmckpt::commit::set_aside``:
        renamed, not deleted) so that the resumed run can save their numbers again: by one
        rank per root (the lowest of its machine with node-local roots, else rank 0), before
        its next collective, so no rank saves before they are moved."""
        me = self.ckpt.rank
        if not (self._leads_machine() if self.node_local else me == 0):
            return
        for s in steps:
            try:
                d = _shmckpt.group_set_aside(self.ckpt.root, s)
                if d is not None:
                    log.warning("rank %d: step %d, which some rank cannot load, set aside as %s", me, s, d)
            except ShmckptError as e:
                log.warning("rank %d: step %d could not be set aside (its number cannot be saved again): %s", me, s, e)

    def _agree_step(self, sel: Optional[int]) -> None:
        me = self.ckpt.rank
        mine = sel if sel is not None else self.ckpt.engine.latest()  # this root's own
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
        obj: List[Any] = [str(self.ckpt.engine.manifest(target)).encode() if me == src else None]
        try:
            self._dist.broadcast_object_list(obj, src=src, group=self.group)
        except RuntimeError as e:
            raise _GroupFailed(f"the replication group failed while sending the manifest of step {target}: {e}") from e
        # One rank per machine (its lowest) adopts it: the machine's ranks share its root.
        err: Optional[str] = None
        if me not in holders and self._leads_machine():
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
        through a link) of the manifest's size, or a memory-only step its engine holds
        (``disk_every``). The load checks every byte of a file."""
        if step in self._memory_steps():
            return True
        try:
            _, entry = self.ckpt.rank_entry(step)
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
        done, self._completed = self._completed, None
        if done is not None and done[0] == step:
            # This rank's image of the step whose commit the agreement completed: served
            # from that memory (checked, and written as its file).
            self._peer, self._image = done[1], (step, done[2])
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
        steps = self._gather(step, "the step every rank loads")
        if len(set(steps)) != 1:
            raise ReplicationError(f"the ranks load different steps: {steps}")
        needs = self._gather(not self._local_ok(step), "who needs a replica")
        self._fetch(step, [q for q, n in enumerate(needs) if n], "is missing or of the wrong size")

    def after_load(self, step: int, err: Optional[BaseException]) -> bool:
        """Collective, after every rank read ``step`` locally (``err``: what this rank's
        read raised, or None): a rank whose file turned out damaged inside (a checksum
        error, a short or malformed file, an I/O error reading it: what
        :meth:`before_load`'s size check cannot see) gets its image from a partner's
        replica as in :meth:`before_load` (checked, written back over the damaged file).
        True when this rank got one: its load reads again. The others, and a rank whose
        error is not damage, go on as they were (re-raising their error)."""
        if self.broken is not None:
            return False
        damaged = isinstance(err, (CorruptError, IoError))
        t0 = time.monotonic()
        try:
            needs = self._gather(damaged, "who read a damaged file")
            needy = [q for q, n in enumerate(needs) if n]
            if not needy:
                return False
            self._fetch(step, needy, f"is damaged ({err})" if damaged else "")
            self.last_fetch_seconds = time.monotonic() - t0
        except _GroupFailed as e:
            self.broken = f"in the load of step {step}: {e} (restart the ranks to replicate again)"
            raise ReplicationError(f"load of step {step}: {e}") from None
        return damaged and self._peer is not None

    def _fetch(self, step: int, needy: List[int], what: str) -> None:
        """The exchange of a load: each rank in ``needy`` (whose file of ``step``
        ``what``, as its message says) gets its image from the first partner in plan order
        whose replica passes every check. Collective."""
        me = self.ckpt.rank
        root = self.ckpt.root
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
        got, refused, _, _ = self._exchange(sends, recvs, paced=False)
        can.clear()
        del recvs
        for src, refusal in refused.items():
            why = f"the image rank {src} was to send was refused before any byte of it came: {refusal}"
            log.warning("rank %d: %s", me, why)
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
            if self._bucket_has(step):
                # The read takes the bucket's copy (the engine's fallback for a lost or
                # damaged file, when the bucket holds the same bytes).
                log.warning("rank %d: step %d: no partner could serve it (%s); reading the bucket's copy", me, step, why)
                return
            _, entry = self.ckpt.rank_entry(step)
            path = os.path.join(root, f"step-{step}", entry["file"])
            raise ReplicationError(f"rank {me}: its file of step {step} ({path}) {what} and {why}")

    def _bucket_has(self, step: int) -> bool:
        """Whether this checkpointer's bucket (``remote=``) has ``step`` committed."""
        return step in self._bucket_steps()

    def _bucket_steps(self) -> List[int]:
        """The steps committed in this checkpointer's bucket (``remote=``): none without
        one, or when they cannot be listed (logged)."""
        if self.ckpt.remote is None:
            return []
        try:
            return list(self.ckpt.engine.list_remote())
        except ShmckptError as e:
            log.warning("rank %d: the bucket's steps are not known (%s): counted as none", self.ckpt.rank, e)
            return []

    def _leads_machine(self) -> bool:
        """Whether this rank is the lowest of its machine: the one that commits, adopts a
        peer's manifest and sets steps aside in the machine's root (node-local roots)."""
        return self.ckpt.rank == min(r for r, n in enumerate(self.nodes) if n == self.node)

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
