"""Ranged reads of rank files for :class:`shmckpt.dcp.ShmckptReader`.

A DCP load plan names the items a rank needs; with replicated state spread over the rank
files and sharded state in each rank's own file, a rank needs a few tensors of each file.
:func:`read_plan_items` reads only those (``_shmckpt.read_rank_ranges``, i.e. Rust's
``shmckpt::restore::load_ranges``): each tensor whole, once, its CRC-32C verified against
the manifest, neighbouring tensors at most ``gap`` bytes apart read together, O_DIRECT
where the filesystem allows. Tensors bound for a destination of the caller's go straight
into it; the others come back in buffers of their own.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .. import _shmckpt, _util
from ..errors import CorruptError, DestinationError

#: ``(name, dtype, shape, crc32c, file offset, nbytes, Buffer or None)``, as
#: ``_shmckpt.read_rank_file`` returns them.
ReadTensor = Tuple[str, str, List[int], int, int, int, Optional[_shmckpt.Buffer]]


def read_plan_items(
    path: str,
    rank: int,
    tensors: Iterable[str],
    device: Sequence[Tuple[str, Any, int]],
    host: Sequence[Tuple[str, Any]],
    *,
    direct_io: bool = True,
    totals: Optional[Dict[str, int]] = None,
) -> Tuple[str, List[ReadTensor]]:
    """Read the tensors ``tensors`` (names; repeats allowed) of ``rank``'s file of the DCP
    checkpoint directory ``path`` and nothing else. ``device`` lists ``(name, CUDA tensor,
    device)`` and ``host`` ``(name, CPU tensor or array)``, each contiguous (handed over as
    DLPack capsules, :func:`shmckpt._util.dest_capsule`): those whole tensors are copied into
    that memory as the file is read (the caller leaves it unused meanwhile); every other tensor named comes back in a buffer of its own. Returns
    ``(file name, [(name, dtype, shape, crc32c, file offset, nbytes, Buffer or None)])``,
    one tuple per tensor read, in file order. ``totals`` (when given) gets the bytes read
    and reads issued added to its ``"bytes"`` and ``"reads"``.

    A tensor the DCP metadata names and the manifest's file does not hold, or of another
    size, is a :class:`CorruptError` (the two disagree); a damaged tensor is a
    ``ChecksumError`` naming it."""
    sent = {d[0] for d in device} | {h[0] for h in host}
    own = sorted(set(tensors) - sent)
    try:
        file, _meta, read, stats = _shmckpt.read_rank_ranges(
            path,
            rank,
            own,
            direct_io=direct_io,
            device=[(n, _util.dest_capsule(t), d) for n, t, d in device] or None,
            host=[(n, _util.dest_capsule(t), 0) for n, t in host] or None,
        )
    except DestinationError as e:
        raise CorruptError(f"{path}: the DCP metadata disagrees with the manifest of rank {rank}'s file: {e}") from e
    if totals is not None:
        totals["bytes"] = totals.get("bytes", 0) + int(stats["bytes"])
        totals["reads"] = totals.get("reads", 0) + int(stats["reads"])
    return file, read
