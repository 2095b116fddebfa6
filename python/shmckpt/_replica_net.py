"""The transport of :mod:`shmckpt.replicas`: collectives and paced point-to-point transfers
over the replication group (a mixin of :class:`~shmckpt.replicas.Replicator`, which holds
the state named below)."""

from __future__ import annotations

import collections
import logging
import time
import warnings
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import ShmckptError

if TYPE_CHECKING:  # pragma: no cover
    from ._host import CheckpointerLike

log = logging.getLogger("shmckpt.replicas")

#: Pacing: a paced send is cut in pieces of this many seconds of the bandwidth...
_PACE_SECONDS = 0.05
#: ...of at least this many bytes and at most this many (unbounded: the largest), rounded
#: down to whole staging chunks of the sender (at least one).
_PIECE_MIN = 64 << 10
_PIECE_MAX = 64 << 20
#: Pieces a sender has in flight at most: their staging chunks (or private copies) are
#: pinned until their sends finished.
_IN_FLIGHT = 4


def _tensor(buf: Any) -> Any:
    """A torch view of ``buf`` (``__array_interface__``), without a copy; read-only memory
    is only ever sent from."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(buf))


class _BufferPieces:
    """The pieces of one buffer in memory (a served replica): slices of it."""

    def __init__(self, buf: Any):
        self._buf = buf
        self._t = _tensor(buf)
        self.nbytes = int(self._t.numel())

    def piece(self, a: int, b: int) -> Any:
        return self._t[a:b]

    def count(self, n: int) -> None:
        pass


class ImagePieces:
    """This rank's image of a step as the pieces it sends, each made when it is sent: from
    the save's staging chunks held for replication (``held``, a ``HeldImage``: a zero-copy
    view of consecutive chunks, else a private copy), else (given back under staging
    pressure, or the image was not held) read from the committed file (``source``, a
    ``ReplicaSource``, read piece by piece). :attr:`sent_from` counts the bytes sent from
    each: ``staging``, ``copied``, ``file``."""

    def __init__(self, source: Any, held: Optional[Any], rank: int):
        self._source = source
        self._held = held
        self._file: Optional[Any] = None
        self._rank = rank
        self._kind = "file"
        self.nbytes = int(source.nbytes)
        self.sent_from: Dict[str, int] = {"staging": 0, "copied": 0, "file": 0}
        #: Why the file could not be read (the rest is sent unread: the receiver refuses it).
        self.problem: Optional[str] = None

    def piece(self, a: int, b: int) -> Any:
        """Bytes ``[a, b)`` as a tensor to send (a piece of the sender's cut)."""
        if self._held is not None:
            try:
                kind, buf = self._held.piece(a, b)
            except ShmckptError as e:  # never expected: the cut follows the chunks
                log.warning("rank %d: piece [%d, %d) not taken from staging: %s", self._rank, a, b, e)
                kind, buf = "file", None
            if buf is not None:
                self._kind = kind
                return _tensor(buf)
        self._kind = "file"
        if self.problem is None:
            # A failed read sends the rest unread (zeros): the receiver's check refuses
            # it, and the problem is reported.
            try:
                self._source.read_range(a, b)
            except ShmckptError as e:
                self.problem = f"rank {self._rank} could not read its image: {e}"
                log.warning("%s", self.problem)
        if self._file is None:
            self._file = _tensor(self._source)
        return self._file[a:b]

    def count(self, n: int) -> None:
        """``n`` bytes of the last piece were sent to one destination."""
        self.sent_from[self._kind] += n


class _GroupFailed(Exception):
    """The replication group failed (internal: turned into
    :class:`~shmckpt.errors.ReplicationError`, and replication stops)."""

    def __init__(self, message: str, peers: Sequence[int] = ()):
        super().__init__(message)
        self.peers = list(peers)


class ReplicaNet:
    """Gathers and exchanges over :attr:`group` (see :class:`~shmckpt.replicas.Replicator`)."""

    ckpt: "CheckpointerLike"
    group: Any
    _dist: Any
    timeout: float
    bandwidth: Optional[float]
    bandwidths: List[Optional[float]]
    chunk_sizes: List[int]

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

    def _piece_size(self, sender: int) -> int:
        """The size of the pieces ``sender``'s images travel in: ``sender``'s paced piece
        (``replica_bandwidth`` x 50 ms, at least 64 KiB, at most 64 MiB; 64 MiB unbounded)
        rounded down to whole staging chunks of ``sender`` (at least one), so that a piece
        never straddles a chunk (every rank knows every rank's settings: both ends cut
        alike)."""
        bw = self.bandwidths[sender]
        paced = _PIECE_MAX if bw is None else max(_PIECE_MIN, min(_PIECE_MAX, int(bw * _PACE_SECONDS)))
        cs = max(1, int(self.chunk_sizes[sender]))
        return cs * max(1, paced // cs)

    def _pieces(self, n: int, sender: int) -> List[Tuple[int, int]]:
        """The ``(start, end)`` pieces an image of ``n`` bytes from ``sender`` travels in."""
        size = self._piece_size(sender)
        return [(a, min(n, a + size)) for a in range(0, n, size)] or [(0, 0)]

    def _agree(
        self, todo: Sequence[Tuple[Any, List[int]]], recvs: Sequence[Tuple[int, Any]]
    ) -> Dict[Tuple[int, int], str]:
        """Before any data moves: every rank announces the images it sends (to whom, how
        many bytes, in pieces of how many) and the ones it expects (from whom, the bytes
        its manifest says, the pieces it cuts them in), gathered on every rank. A pair
        ``(src, dst)`` on which the two do not agree is refused on both ends alike (every
        rank computes the same verdict from the same announcements): the receiver posts
        no receive for it and the sender sends it nothing, so a peer announcing a size we
        do not expect can never make a receive overflow (gloo aborts the process when a
        message is larger than the buffer posted for it). Returns the refused pairs this
        rank is an end of, with why."""
        me = self.ckpt.rank
        announced = {dst: (int(src.nbytes), self._piece_size(me)) for src, dsts in todo for dst in dsts}
        expected = {src: (int(np.asarray(buf).nbytes), self._piece_size(src)) for src, buf in recvs}
        everyone = self._gather((announced, expected), "the sizes of the images to exchange")
        world = self.ckpt.world_size

        def sizes(obj: Any) -> Optional[Dict[int, Tuple[int, int]]]:
            # What a peer announced, checked: ranks in the world, sizes non-negative
            # integers, pieces positive (anything else: the peer's pairs are refused).
            if not isinstance(obj, dict):
                return None
            out: Dict[int, Tuple[int, int]] = {}
            for k, v in obj.items():
                if not (type(k) is int and 0 <= k < world and isinstance(v, tuple) and len(v) == 2):
                    return None
                n, piece = v
                if not (type(n) is int and type(piece) is int and n >= 0 and piece > 0):
                    return None
                out[k] = (n, piece)
            return out

        sends: List[Optional[Dict[int, Tuple[int, int]]]] = []
        wants: List[Optional[Dict[int, Tuple[int, int]]]] = []
        for obj in everyone:
            ok = isinstance(obj, tuple) and len(obj) == 2
            sends.append(sizes(obj[0]) if ok else None)
            wants.append(sizes(obj[1]) if ok else None)

        def say(v: Tuple[int, int]) -> str:
            return f"{v[0]} bytes in pieces of {v[1]}"

        refused: Dict[Tuple[int, int], str] = {}
        # The pairs this rank is an end of (both ends of a pair judge it from the same
        # announcements, so alike).
        pairs = [(me, r) for r in range(world)] + [(r, me) for r in range(world) if r != me]
        for src, dst in pairs:
            s, w = sends[src], wants[dst]
            if not ((s is not None and dst in s) or (w is not None and src in w)):
                continue  # neither end says this pair exchanges anything
            if s is None or w is None:
                refused[(src, dst)] = f"rank {src if s is None else dst} announced sizes that are not sizes"
            elif dst not in s:
                refused[(src, dst)] = f"rank {dst} expects {say(w[src])} from rank {src}, which sends it nothing"
            elif src not in w:
                refused[(src, dst)] = f"rank {src} announced {say(s[dst])} to rank {dst}, which expects nothing from it"
            elif s[dst] != w[src]:
                refused[(src, dst)] = f"rank {src} announced {say(s[dst])}, rank {dst} expects {say(w[src])}"
        for (src, dst), why in refused.items():
            log.warning("rank %d: the transfer of rank %d's image to rank %d is refused: %s", me, src, dst, why)
        return refused

    def _exchange(
        self, sends: Sequence[Tuple[int, Any]], recvs: Sequence[Tuple[int, Any]], paced: bool
    ) -> Tuple[Dict[int, Any], Dict[int, str], int, float]:
        """Send each ``(dst, source)`` and receive each ``(src, buffer)`` (buffers: objects
        numpy views without a copy, ``__array_interface__``: a ``ReplicaImage`` or a
        ``Buffer``, the received ones writable; a source is such a buffer or an
        :class:`ImagePieces`, which makes each piece when it is sent; one source given for
        several destinations is cut once, each piece sent to all of them). Receives are
        posted first, then the sends, piece by piece, one source after the other in turn,
        no faster than :attr:`bandwidth` when ``paced``; at most :data:`_IN_FLIGHT` pieces
        are in flight (a piece is dropped, its staging chunks given back, once its sends
        finished). First the sizes are agreed (:meth:`_agree`): a transfer whose sender
        announced other sizes than its receiver expects is refused on both ends, before
        any receive is posted. Returns the receive buffers by source (filled), the
        refused receives by source (why), the bytes sent and the seconds the exchange
        took. A transfer that fails (the peer died, or was silent for
        the group's timeout) raises :class:`_GroupFailed` naming the peers, once every
        other transfer has finished or failed."""
        import torch

        dist = self._dist
        me = self.ckpt.rank
        t0 = time.monotonic()
        works: List[Tuple[int, str, Any]] = []
        # Received pieces of an image, in order: each frozen and checked as it arrives
        # (`received`: the header, the tensors it completes), a restore's also written to
        # its file, so the checks and the write-back overlap the rest of the transfer and
        # the seal checks only what the last pieces completed.
        through: Dict[int, Tuple[Any, int]] = {}
        failed: Dict[int, str] = {}
        got: Dict[int, Any] = {}
        # Each source once, with its destinations and its pieces.
        todo: List[Tuple[Any, List[int], List[Tuple[int, int]]]] = []
        by_id: Dict[int, int] = {}
        for dst, obj in sends:
            if id(obj) not in by_id:
                src_pieces = obj if isinstance(obj, ImagePieces) else _BufferPieces(obj)
                by_id[id(obj)] = len(todo)
                todo.append((src_pieces, [], self._pieces(src_pieces.nbytes, me)))
            todo[by_id[id(obj)]][1].append(dst)
        refused_pairs = self._agree([(p, d) for p, d, _ in todo], recvs)
        for _, dsts, _ in todo:
            dsts[:] = [d for d in dsts if (me, d) not in refused_pairs]
        refused: Dict[int, str] = {}
        views = []
        for src, buf in recvs:
            if (src, me) in refused_pairs:
                refused[src] = refused_pairs[(src, me)]
                continue  # no receive posted: nothing the sender sends can land in it
            t = torch.from_numpy(np.asarray(buf))
            views.append(t)
            got[src] = buf
            for a, b in self._pieces(t.numel(), src):
                try:
                    w = dist.irecv(t[a:b], src=src, group=self.group)
                    if hasattr(buf, "received"):
                        through[id(w)] = (buf, b)
                    works.append((src, "receiving from", w))
                except RuntimeError as e:
                    failed.setdefault(src, f"receiving from rank {src}: {e}")
        inflight: Deque[Tuple[Any, List[Tuple[int, Any]]]] = collections.deque()

        def finish(entry: Tuple[Any, List[Tuple[int, Any]]]) -> None:
            for peer, w in entry[1]:
                try:
                    w.wait()
                except RuntimeError as e:
                    failed.setdefault(peer, f"sending to rank {peer}: {e}")

        done = 0  # works[:done]: received, and checked as they arrived

        def receive(block: bool) -> None:
            """Take the received pieces in order: all of them (``block``), or those that
            arrived already (between sends: the checks overlap the transfer)."""
            nonlocal done, through
            while done < len(works) and (block or works[done][2].is_completed()):
                peer, what, w = works[done]
                done += 1
                try:
                    w.wait()
                except RuntimeError as e:
                    failed.setdefault(peer, f"{what} rank {peer}: {e}")
                hook = through.pop(id(w), None)
                if hook is not None and peer not in failed:
                    try:
                        hook[0].received(hook[1])
                    except ShmckptError as e:  # seal() checks (and writes) what is left, or refuses
                        log.warning("rank %d: the image from rank %d, checked as it arrived: %s", me, peer, e)
                        through = {k: v for k, v in through.items() if v[0] is not hook[0]}

        sent = 0
        bw = self.bandwidth if paced else None

        def pace() -> None:
            if bw is not None:
                ahead = t0 + sent / bw - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)

        while any(p for _, _, p in todo):
            for src_pieces, dsts, pieces in todo:
                if not pieces:
                    continue
                a, b = pieces.pop(0)
                live = [d for d in dsts if d not in failed]
                if not live:
                    continue
                pace()  # before the piece is made: it pins staging chunks (or memory) from then on
                t = src_pieces.piece(a, b)
                if t.numel() != b - a:  # never expected: the bytes sent are exactly the ones agreed
                    log.warning("rank %d: piece [%d, %d) made %d bytes: zeros sent instead", me, a, b, t.numel())
                    t = torch.zeros(b - a, dtype=torch.uint8)
                posted: List[Tuple[int, Any]] = []
                for dst in live:
                    pace()
                    try:
                        posted.append((dst, dist.isend(t, dst=dst, group=self.group)))
                    except RuntimeError as e:
                        failed.setdefault(dst, f"sending to rank {dst}: {e}")
                        continue
                    src_pieces.count(b - a)
                    sent += b - a
                inflight.append((t, posted))
                del t
                receive(block=False)
                while len(inflight) > _IN_FLIGHT:
                    finish(inflight.popleft())
        while inflight:
            finish(inflight.popleft())
        receive(block=True)
        del todo, views
        if failed:
            got.clear()
            peers = ", ".join(f"rank {p}" for p in sorted(failed))
            raise _GroupFailed(
                f"the transfer with partner {peers} failed (it died, or was silent for more "
                f"than the group's timeout, {self.timeout:g} s by default): " + "; ".join(failed.values()),
                peers=sorted(failed),
            )
        return got, refused, sent, time.monotonic() - t0

    # -- the replication thread --------------------------------------------------------
