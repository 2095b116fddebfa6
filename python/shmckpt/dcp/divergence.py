"""The replica divergence check of :class:`~shmckpt.dcp.ShmckptWriter`
(``check_replicas=group``, docs/guarantees.md "Replica divergence"): the Checkpointer's
check (``shmckpt._divergence.ReplicaCheck``: one gather of ``(name, dtype, shape,
crc32c)`` per tensor, ``shmckpt::divergence::compare``, the decision, the engine's held
commit) applied to a DCP save.

DCP's planning saves a replicated item once (one rank, its *owner*, stages and writes it),
so the other ranks' copies are not in any file: they are checksummed here, when the save
snapshots the state (``stage()``, or ``write_data`` for ``dcp.save``), and their digests
join the CRC-32Cs the owner's engine computed as its file drained. An item's digest name is
its DCP key: ``fqn``, or ``fqn@o1,o2,...`` for a shard not at the origin, so shards of
different places are never compared. The check runs in ``write_data`` (DCP's upload
thread with ``async_save``) on a private gloo group of the same ranks, made once, so it
never interleaves with the trainer's collectives on the group given.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex

from .. import _shmckpt, _state, _util
from .._divergence import OnDivergence, ReplicaCheck
from ..errors import CommitRefused, ReplicaDivergence
from .items import _key, _offsets_of, _Save

#: (name, dtype, shape, crc32c): one digest, as the engine's ``checksums()`` gives it.
Digest = Tuple[str, str, List[int], int]

_groups_lock = threading.Lock()
#: ranks -> (the default group it was made under, the private gloo group)
_groups: Dict[Tuple[int, ...], Tuple[Any, Any]] = {}


def _private_group(group: Any) -> Any:
    """A gloo group of the same ranks as ``group`` (made once per set of ranks, by those
    ranks only, again after the default group was made anew)."""
    world = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else world))
    with _groups_lock:
        made = _groups.get(ranks)
        if made is None or made[0] is not world:
            made = (world, dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True))
            _groups[ranks] = made
        return made[1]


def digest_name(index: MetadataIndex) -> str:
    """The name an item is compared under: its fqn, with its offsets when not all zero."""
    offsets = _offsets_of(index)
    if any(offsets):
        return f"{index.fqn}@{','.join(map(str, offsets))}"
    return index.fqn


def tensor_digest(name: str, t: torch.Tensor) -> Optional[Digest]:
    """The digest of ``t``'s values as the engine would store them (row-major, values of a
    conjugate or negative view applied), or None for a value the engine cannot store."""
    st = _state.TORCH_TO_ST.get(t.dtype)
    if st is None:
        return None
    h = t.detach()
    if not h.is_cpu:
        h = h.cpu()
    if _state.is_lazy(h):
        h = _state.resolved(h)
    h = h.contiguous()
    nbytes = h.numel() * h.element_size()
    crc = _shmckpt.crc32c_of(_util.capsule(h) if nbytes else None)
    return (name, st, list(h.shape), int(crc))


class DcpReplicaCheck:
    """The divergence check of one :class:`~shmckpt.dcp.ShmckptWriter`."""

    def __init__(self, group: Any, on_divergence: OnDivergence, dcp_group: Any = None):
        from ..errors import ConfigError

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("check_replicas needs torch.distributed initialized")
        # Ranks are named as DCP numbers its rank files (DCP's group).
        self.replica = ReplicaCheck(dist.get_rank(dcp_group), _private_group(group), on_divergence)

    def snapshot(self, save: _Save, items: Sequence[Tuple[MetadataIndex, Any]]) -> None:
        """Checksum this rank's copies of the replicated tensor ``items`` another rank
        writes (called while the state is the save's snapshot)."""
        out = []
        for index, obj in items:
            if isinstance(obj, torch.Tensor):
                d = tensor_digest(digest_name(index), obj)
                if d is not None:
                    out.append(d)
        save.replica_digests = out

    def check(self, save: _Save) -> Optional[ReplicaDivergence]:
        """Gather this rank's digests of ``save`` over the group, compare, decide and
        confirm or refuse the engine's held commit (every rank of the group must call it
        for the same saves, in order). Returns the divergence (committed anyway), or None;
        raises :class:`ReplicaDivergence` when the save is not committed because of it, and
        the group's error when the check failed."""
        rust = save.handle
        why = ""
        digests: Optional[List[Digest]] = None
        try:
            digests = self._owned(save) + list(save.replica_digests)
        except Exception as e:  # the save failed before its file was durable
            why = f"{type(e).__name__}: {e}"
        try:
            err = self.replica.check_step(save.step, digests, why, rust, what=f"checkpoint {save.path}")
        except BaseException as e:
            # Whatever failed, the held commit is decided (refused), never left waiting.
            rust.confirm_commit(f"replica check of checkpoint {save.path} failed: {type(e).__name__}: {e}")
            raise
        if err is not None and not err.committed:
            try:
                rust.wait()  # refused: the engine removed this rank's file
            except CommitRefused:
                pass
            raise err
        return err

    @staticmethod
    def _owned(save: _Save) -> List[Digest]:
        """The digests the engine computed of what this rank staged, under item names."""
        by_engine = {it.name: digest_name(idx) for idx, it in save.items.items()}
        sums = ReplicaCheck.wait_checksums(save.handle)
        return [(by_engine.get(n, n), dt, list(shape), int(crc)) for n, dt, shape, crc in sums]


def local_unplanned(planner: Any, plan: Any) -> List[Tuple[MetadataIndex, Any]]:
    """``dcp.save``: this rank's tensor items that DCP's de-duplication left to another
    rank (every item of the planner's state dict not in this rank's ``plan``), with their
    data."""
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    flat = getattr(planner, "state_dict", None)
    if not isinstance(flat, dict):
        return []
    planned = {_key(wi.index) for wi in plan.items}
    out = []
    for fqn, obj in flat.items():
        if not isinstance(obj, torch.Tensor):
            continue
        for wi in _create_write_items(fqn, obj):
            if wi.type != WriteItemType.BYTE_IO and _key(wi.index) not in planned:
                out.append((wi.index, planner.resolve_data(wi)))
    return out
