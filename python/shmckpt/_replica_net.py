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
        # Received pieces of an image, in order: each frozen and checked as it arrives
        # (`received`: the header, the tensors it completes), a restore's also written to
        # its file, so the checks and the write-back overlap the rest of the transfer and
        # the seal checks only what the last pieces completed.
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
                    if hasattr(buf, "received"):
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
                    hook[0].received(hook[1])
                except ShmckptError as e:  # seal() checks (and writes) what is left, or refuses
                    log.warning("rank %d: the image from rank %d, checked as it arrived: %s", me, peer, e)
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
