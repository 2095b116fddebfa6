"""The object-storage tier seen from Python: which tier serves a load, and the bucket's
manifests and skeletons. The protocol (uploads, the commit rule, retention, checks of what
the bucket returns) is the Rust engine's (``EngineConfig::with_remote``); this module only
chooses between the local disk and the bucket.

``Checkpointer(root, remote="s3://bucket/prefix", remote_keep_last=N)`` mirrors every
committed save to the bucket; ``SaveHandle.wait_remote()`` waits for the step to be
committed there; ``Checkpointer.list(remote=True)`` lists the bucket;
``Checkpointer.load(step, source="remote")`` reads from it, and ``load("latest")`` falls
back to it when the local disk holds no checkpoint (or not the requested step).

``Checkpointer("s3://bucket/prefix")`` is remote only: the engine writes no file; each
save is uploaded from the staging memory, which the upload alone releases; loads come from
the bucket. The engine's root is a private scratch directory holding only its lock file,
made with ``tempfile.mkdtemp`` (``TMPDIR``) and removed by ``close``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from . import _state, _util
from .errors import ConfigError, CorruptError, DestinationError, NotFound


class Checkpointer(Protocol):
    """What this module uses of a :class:`~shmckpt.Checkpointer`: the state its
    collaborators share (``checkpointer.base.Shared``), declared here, so that the tier
    does not import the checkpointer that composes it."""

    rank: int
    remote: Optional[str]
    engine: Any

__all__ = [
    "SOURCES",
    "shared_session",
    "resolve",
    "skeleton",
    "entry_of",
    "copy_into",
    "scratch_for",
    "remove_scratch",
    "rank_entry",
    "load_to_device",
    "read_into_device",
]

#: Accepted values of ``Checkpointer.load(..., source=...)``: ``None`` picks (memory, then
#: the local disk, then the bucket), ``"local"`` reads memory or disk only, ``"remote"``
#: reads the bucket only.
SOURCES = (None, "local", "remote")


def resolve(ck: "Checkpointer", step: Optional[int], source: Optional[str]) -> Tuple[int, str]:
    """The step to load (``None``: the latest) and where from: ``"local"`` (memory or
    disk, the engine picks) or ``"remote"``: the engine's one fallback order
    (``Engine::resolve_step``; ``Checkpointer.latest`` and ``list`` follow it too).
    Without ``source``, a step the local disk holds (the latest: the disk's newest, when it
    holds any) is loaded locally, else from the bucket when there is one."""
    check_source(source)
    if source == "remote" and ck.remote is None:
        raise ConfigError("this Checkpointer has no remote tier (remote=...)")
    s, where = ck.engine.resolve(step, source)
    return int(s), str(where)


def check_source(source: Optional[str]) -> None:
    """``ValueError`` unless ``source`` is one of :data:`SOURCES`."""
    if source not in SOURCES:
        raise ValueError(f"source must be None, 'local' or 'remote', not {source!r}")


def skeleton(ck: "Checkpointer", step: int, file_meta: Dict[str, str]) -> Optional[Any]:
    """The state skeleton this rank saved with ``step``, from its file's header metadata
    (as a local load reads it), or ``None`` for a checkpoint not written by this
    package."""
    text = file_meta.get(_state.STATE_KEY)
    if text is None:
        return None
    try:
        return _state.decode(text)
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptError(
            f"{ck.remote}/step-{step}: malformed {_state.STATE_KEY} metadata: {e}"
        ) from None


def rank_entry(ck: "Checkpointer", step: int) -> Dict[str, Any]:
    """This rank's file entry (names, dtypes, shapes, in file order) of ``step``'s manifest
    in the bucket (parsed and checked by the engine)."""
    m = json.loads(ck.engine.remote_manifest(step))
    for f in m["files"]:
        if f["rank"] == ck.rank:
            return dict(f)
    raise NotFound(f"{ck.remote}/step-{step} has no file of rank {ck.rank}")


def read_into_device(ck: "Checkpointer", step: int, dest: Sequence[Tuple[str, Any, int]]) -> None:
    """Read ``step`` from the bucket into device tensors ``(name, tensor, device)`` (each
    contiguous, handed over as a DLPack capsule, :func:`shmckpt._util.dest_capsule`; every
    tensor of this rank's file, each exactly its size): ranged GETs in
    parallel, each body copied into the engine's CUDA-registered staging buffers and sent
    to the device from there (no host copy of the file), every CRC-32C verified. The
    caller synchronized the destinations' streams."""
    ck.engine.load_into_device_remote(step, [(n, _util.dest_capsule(x), d) for n, x, d in dest])


def load_to_device(ck: "Checkpointer", step: int, dev: Any) -> Tuple[Dict[str, Any], Optional[Any], Dict[str, Any]]:
    """``Checkpointer.load(step, map_location=dev)`` from the bucket: new tensors on CUDA
    device ``dev`` (an index set), filled by :func:`read_into_device`. Returns ``(tensors
    by name, the skeleton or None, this rank's file entry)``."""
    import torch

    entry = rank_entry(ck, step)
    tree = skeleton(ck, step, ck.engine.remote_file_metadata(step))
    objs: Dict[str, Any] = {}
    for t in entry["tensors"]:
        tdt = _state.ST_TO_TORCH.get(t["dtype"])
        if tdt is None:
            raise DestinationError(f"tensor {t['name']!r}: dtype {t['dtype']} has no torch dtype")
        objs[t["name"]] = torch.empty(t["shape"], dtype=tdt, device=dev)
    # The memory may come from blocks freed by work still queued on this stream.
    torch.cuda.current_stream(dev).synchronize()
    read_into_device(ck, step, [(n, x, dev.index) for n, x in objs.items()])
    return objs, tree, entry


def scratch_for(root: str, remote: Optional[str]) -> Tuple[Optional[str], str, bool]:
    """For a ``Checkpointer`` root: ``(scratch directory or None, the engine's root,
    remote only)``. A root of ``s3://...`` is remote only (``remote`` must then be
    unset)."""
    if not root.startswith("s3://"):
        return None, root, False
    if remote is not None:
        raise ConfigError(f"root {root!r} is a bucket: give remote=... only with a local root")
    scratch = tempfile.mkdtemp(prefix="shmckpt-scratch-")
    return scratch, scratch, True


def remove_scratch(path: str) -> None:
    """Remove a remote-only checkpointer's scratch directory (and what is left in it)."""
    shutil.rmtree(path, ignore_errors=True)


def entry_of(tensors: Sequence[Tuple[str, str, List[int], Any]]) -> Dict[str, Any]:
    """A file entry (names, dtypes, shapes) for tensors loaded from the bucket."""
    return {"tensors": [{"name": n, "dtype": d, "shape": list(sh)} for n, d, sh, _ in tensors]}


def copy_into(tensors: Sequence[Tuple[str, str, List[int], Any]], plan: Dict[str, List[Tuple[Any, Any]]]) -> None:
    """Copy tensors loaded from the bucket into ``load_into``'s destinations (``plan``:
    stored name -> [(leaf, destination)], dtypes and shapes already matched)."""
    import torch

    with torch.no_grad():
        for name, dtype, shape, buf in tensors:
            dests = plan.get(name)
            if not dests:
                continue
            raw = np.asarray(buf)
            for _, d in dests:
                if isinstance(d, np.ndarray):
                    d[...] = raw.view(_state.ST_TO_NUMPY[dtype]).reshape(shape)
                else:
                    u8 = torch.from_numpy(raw) if raw.size else torch.empty(0, dtype=torch.uint8)
                    d.copy_(u8.view(_state.ST_TO_TORCH[dtype]).reshape(shape))


def shared_session() -> str:
    """A random id chosen by rank 0 and broadcast to every rank (``torch.distributed``
    must be initialized): the session of this run's checkpointers (the engine's
    ``session``: a manifest part of another session never counts toward a commit, on
    disk or in the bucket)."""
    import uuid

    import torch.distributed as dist

    obj = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return str(obj[0])
