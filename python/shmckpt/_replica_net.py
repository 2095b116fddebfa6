"""The transport of :mod:`shmckpt.replicas`: collectives and paced point-to-point transfers
over the replication group (a mixin of :class:`~shmckpt.replicas.Replicator`, which holds
the state named below)."""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import ShmckptError

if TYPE_CHECKING:  # pragma: no cover
    from .checkpointer import Checkpointer

log = logging.getLogger("shmckpt.replicas")

#: Pacing: a paced send is cut in pieces of this many seconds of the bandwidth...
_PACE_SECONDS = 0.05
#: ...of at least this many bytes and at most this many (unbounded: the largest).
_PIECE_MIN = 64 << 10
_PIECE_MAX = 64 << 20
#: Pieces of one image posted for receiving at a time (reserved just before).
_WINDOW = 4


class _GroupFailed(Exception):
    """The replication group failed (internal: turned into
    :class:`~shmckpt.errors.ReplicationError`, and replication stops)."""

    def __init__(self, message: str, peers: Sequence[int] = ()):
        super().__init__(message)
        self.peers = list(peers)


class ReplicaNet:
    """Gathers and exchanges over :attr:`group` (see :class:`~shmckpt.replicas.Replicator`)."""

    ckpt: "Checkpointer"
    group: Any
    _dist: Any
    timeout: float
    bandwidth: Optional[float]
    bandwidths: List[Optional[float]]
    _send_problem: Optional[str]

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
        failed: Dict[int, str] = {}
        got: Dict[int, Any] = {}
        # Each image is received in pieces, at most _WINDOW of them posted at a time: a
        # piece's memory is reserved (`reserve`: a replica's /dev/shm pages allocated)
        # just before its receive is posted, and each completed piece, in order, is handed
        # to the image (`received`: frozen read-only and CRC-summed, a restore's written
        # to its file) while the next ones travel; so allocating, checking and writing
        # back overlap the transfer, and `seal()` only finishes. A reservation that fails
        # (a full /dev/shm) receives the rest into scratch memory: that image is never
        # sealed. By source: [buffer, its tensor, pieces to post, posted (work, end), pieces].
        incoming: Dict[int, List[Any]] = {}
        for src, buf in recvs:
            t = torch.from_numpy(np.asarray(buf))
            got[src] = buf
            pieces = self._pieces(t.numel(), src)
            incoming[src] = [buf, t, pieces, [], len(pieces)]
        scratch: Dict[int, Any] = {}

        def post(src: int) -> None:
            buf, t, todo_, posted, count = incoming[src]
            while todo_ and len(posted) < _WINDOW and src not in failed:
                # The posted pieces are consecutive: their slots in scratch differ.
                slot = (count - len(todo_)) % _WINDOW
                a, b = todo_.pop(0)
                into = t[a:b]
                reserve = getattr(buf, "reserve", None)
                if src in scratch:
                    into = scratch[src][slot][: b - a]
                elif reserve is not None:
                    try:
                        reserve(b)
                    except ShmckptError as e:
                        log.warning("rank %d: no memory to receive rank %d's image: %s", me, src, e)
                        size = max(y - x for x, y in self._pieces(t.numel(), src))
                        scratch[src] = [torch.empty(size, dtype=torch.uint8) for _ in range(_WINDOW)]
                        into = scratch[src][slot][: b - a]
                try:
                    posted.append((dist.irecv(into, src=src, group=self.group), b))
                except RuntimeError as e:
                    failed.setdefault(src, f"receiving from rank {src}: {e}")

        def take_received(block: bool) -> None:
            """Hand each image the prefix of its pieces that arrived (waiting for every one
            when ``block``) and post the next ones. After a failure the pieces posted are
            still waited (they fail fast), so nothing writes the memory once it is freed."""
            for src in list(incoming):
                buf, _, todo_, posted, _ = incoming[src]
                while posted:
                    w, end = posted[0]
                    if not block and not w.is_completed():
                        break
                    try:
                        w.wait()
                    except RuntimeError as e:
                        failed.setdefault(src, f"receiving from rank {src}: {e}")
                    posted.pop(0)
                    if src not in failed and src not in scratch and hasattr(buf, "received"):
                        try:
                            buf.received(end)
                        except ShmckptError as e:  # seal() checks what is left, or fails
                            log.warning("rank %d: checking the image from rank %d as it arrived failed: %s", me, src, e)
                    post(src)
                if not posted and (not todo_ or src in failed):
                    del incoming[src]

        for src in list(incoming):
            post(src)
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
                take_received(block=False)
                if bw is not None:
                    ahead = t0 + sent / bw - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
                try:
                    works.append((dst, "sending to", dist.isend(t[a:b], dst=dst, group=self.group)))
                except RuntimeError as e:
                    failed.setdefault(dst, f"sending to rank {dst}: {e}")
                sent += b - a
        while incoming:
            take_received(block=True)
        for peer, what, w in works:
            try:
                w.wait()
            except RuntimeError as e:
                failed.setdefault(peer, f"{what} rank {peer}: {e}")
        del keep
        scratch.clear()
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
