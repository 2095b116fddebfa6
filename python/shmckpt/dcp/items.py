"""The items of one DCP save on one rank: what was staged, which rank writes each
replicated item, and the size bounds of the file the engine lays out."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from . import bucket as _dcp_remote
from .storage import METADATA_FILE


# -- staging ------------------------------------------------------------------------------


@dataclass
class _Item:
    index: MetadataIndex
    name: str
    nbytes: int


class _Save:
    """One save of one rank: what the engine was given and its handle.

    Pickled (handed to DCP's checkpoint process with its state dict: see
    ``staging.StagedState``), it is its description only: no handle, no tensor; the
    sender waited for it, and ``report`` (the engine's report: this rank's file is
    durable) or ``error`` (why the save failed) says how it ended."""

    def __init__(self, spool: str, step: int, path: str):
        self.spool = spool
        self.step = step
        self.path = path
        self.items: Dict[MetadataIndex, _Item] = {}
        self.handle: Any = None
        self.file = ""
        self.rank = 0
        self.world = 1
        #: The flattened tensors stage() was given (identity check in write_data).
        self.leaves: Dict[str, Any] = {}
        #: With several ranks: which rank writes each planned item (see ``_assign_owners``);
        #: this rank staged only its own. ``None``: every item of this rank was staged.
        self.owners: Optional[Dict[Tuple[str, Any], int]] = None
        #: check_replicas: this rank's digests of the replicated items another rank writes.
        self.replica_digests: List[Any] = []
        #: A save handed over by another process: the engine's report, or why it failed.
        self.report: Optional[Dict[str, Any]] = None
        self.error: Optional[str] = None
        #: ... and the error itself when it is shmckpt's and pickles (``ReplicaDivergence``,
        #: ``CommitRefused``): the receiver raises it as the staging process would have.
        self.failure: Optional[BaseException] = None

    def __getstate__(self) -> Dict[str, Any]:
        # Handed over once checked and durable (``_hand_off``): no handle, no leaves, and
        # no digests (the replica check ran in the process that staged it).
        state = dict(self.__dict__)
        state["handle"] = None
        state["leaves"] = {}
        state["replica_digests"] = []
        return state

    @property
    def received(self) -> bool:
        """Whether this save was staged by another process (it has no handle)."""
        return self.handle is None and (self.report is not None or self.error is not None)

    def matches(self, planned: Any) -> bool:
        """Whether DCP is saving the state this save staged: the planner's flattened
        state dict holds the very tensor objects stage() saw."""
        if not isinstance(planned, dict):
            return True  # a planner without a flat state dict: cannot tell
        common = [k for k in self.leaves if k in planned]
        return bool(common) and all(planned[k] is self.leaves[k] for k in common)

    @property
    def step_dir(self) -> str:
        return os.path.join(self.spool, f"step-{self.step}")


def _offsets_of(index: MetadataIndex) -> List[int]:
    return [int(x) for x in index.offset] if index.offset is not None else []


def _item_bytes(obj: Any) -> int:
    """Bytes of a planned item's data: a tensor, or the serialized bytes of a value."""
    return int(obj.numel() * obj.element_size()) if isinstance(obj, torch.Tensor) else len(obj)


def _key(index: MetadataIndex) -> Tuple[str, Any]:
    """What identifies a planned item across ranks (``MetadataIndex`` equality: fqn and
    offset)."""
    return (index.fqn, tuple(int(x) for x in index.offset) if index.offset is not None else None)


def _assign_owners(gathered: Sequence[Sequence[Tuple[Tuple[str, Any], int]]]) -> Dict[Tuple[str, Any], int]:
    """Given every rank's items (key, bytes), in rank order, pick the one rank that writes
    each item: an item on several ranks (a replicated tensor or value) goes to the rank
    with the fewest bytes assigned so far (the lowest such rank on a tie), the way DCP's
    planner de-duplicates. Deterministic: every rank computes the same from the same
    lists."""
    ranks_of: Dict[Tuple[str, Any], List[int]] = {}
    size_of: Dict[Tuple[str, Any], int] = {}
    for r, items in enumerate(gathered):
        for key, nbytes in items:
            ranks_of.setdefault(key, []).append(r)
            size_of[key] = nbytes
    assigned = [0] * len(gathered)
    owners: Dict[Tuple[str, Any], int] = {}
    for key, ranks in ranks_of.items():
        pick = min(ranks, key=lambda r: (assigned[r], r))
        assigned[pick] += size_of[key] or 1
        owners[key] = pick
    return owners


def _check_target(path: str, overwrite: bool = False) -> None:
    """Refuse a target the save could not publish to: a link or a file, or a non-empty
    directory, unless ``overwrite`` and the directory is a DCP checkpoint (it has a
    regular ``.metadata``: the publish then replaces it atomically)."""
    if _dcp_remote.is_remote(path):
        _dcp_remote.check_target(path)
        return
    if os.path.lexists(path):
        if os.path.islink(path) or not os.path.isdir(path):
            raise FileExistsError(f"{path}: exists and is not a directory; ShmckptWriter never publishes over it")
        if not os.listdir(path):
            return
        md = os.path.join(path, METADATA_FILE)
        if overwrite and os.path.isfile(md) and not os.path.islink(md):
            return
        raise FileExistsError(
            f"{path}: the checkpoint directory exists and is not empty"
            + (" and holds no DCP checkpoint (.metadata)" if overwrite else " (overwrite=False)")
            + "; ShmckptWriter never overwrites it"
        )


def _entry_bound(name: str, ndim: int) -> int:
    """An upper bound of one item's entry in the safetensors header."""
    return 2 * len(name.encode()) + 96 + 24 * ndim


def _estimate_file(items_header: int, data: int, meta: Dict[str, str]) -> int:
    """An upper bound of the safetensors file the engine will lay out: ``data`` bytes of
    items, whose header entries take at most ``items_header`` bytes (the sum of their
    ``_entry_bound``), and the metadata ``meta``."""
    header = 8 + 4096 + len(json.dumps(meta)) * 2 + items_header
    return data + -(-header // 4096) * 4096


def _copy_containers(x: Any) -> Any:
    """New dicts and lists around the same leaves (DCP plans from this copy while the
    trainer may change its own containers)."""
    if isinstance(x, dict):
        return {k: _copy_containers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy_containers(v) for v in x]
    return x
