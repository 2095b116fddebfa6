"""DCP checkpoints in a bucket: ``ShmckptWriter("s3://bucket/prefix/step-N")`` and
``ShmckptReader("s3://bucket/prefix/step-N")`` (see ``docs/dcp.md``, "In a bucket").

An ``s3://`` checkpoint path names step ``N`` of the bucket root ``s3://bucket/prefix``
(its last component must be ``step-N``): the checkpoint is an ordinary committed shmckpt
step of that root (``shmckpt inspect``/``verify``/``Checkpointer.list(remote=True)`` see
it), plus DCP's ``.metadata`` object beside it::

    prefix/step-N/rank-00000-of-00002.safetensors   each rank's object (multipart upload)
    prefix/step-N/rank-00000.manifest.json          each rank's manifest part
    prefix/step-N/manifest.json                     the bucket commit (Rust, conditional create)
    prefix/step-N/.metadata                         DCP's metadata, written last by the coordinator

Each rank's engine is remote only (``Checkpointer("s3://...")``'s mode): it stages the
rank's tensors into its arena, writes the file to a private scratch directory, uploads it
and its manifest part, and the last rank's upload commits ``manifest.json`` (the one
commit protocol: ``shmckpt::remote``). ``write_data`` returns once the step is committed in
the bucket; DCP's coordinator (``finish``) then builds the storage entries from the
bucket's manifest (offset, length, CRC-32C of every item) and creates ``.metadata`` with a
conditional create. A DCP load needs both: a step without ``.metadata`` is a save that did
not finish. Reads fetch each needed rank object with ranged GETs in parallel, checked
against the manifest (size, header, every CRC-32C) by Rust, and compare every item with
the DCP metadata.

Ranks of one run agree on a session id (rank 0 broadcasts it at the first save), recorded
in each manifest part: a rank's object left by an interrupted earlier save of the same
step never commits with this run's.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
import threading
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .. import _shmckpt
from ..errors import ConfigError, CorruptError, NotFound

__all__ = ["is_remote", "split", "norm"]

_STEP_RE = re.compile(r"step-(\d{1,19})")
METADATA_NAME = ".metadata"



class BucketSession:
    """What this process knows of the buckets DCP saves to and loads from: the open
    buckets (opening one lists the bucket), the session id the ranks agreed on per (root,
    world size), and the scratch directories of the remote-only engines it opened (removed
    at exit). One instance, :data:`BUCKETS`, exists per process, for the reasons
    :class:`shmckpt.dcp.engines.DcpSession` gives: DCP builds a new writer and reader per
    save and load, and the ranks' session id must outlive them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: Dict[str, Any] = {}
        self._sessions: Dict[Tuple[str, int], str] = {}
        self._scratch: List[str] = []

    def bucket(self, root: str) -> Any:
        """The open bucket of ``root`` (``_shmckpt.Bucket``), opened once per process."""
        with self._lock:
            b = self._buckets.get(root)
        if b is None:
            b = _shmckpt.Bucket(root)
            with self._lock:
                b = self._buckets.setdefault(root, b)
        return b

    def session(self, key: Tuple[str, int]) -> Optional[str]:
        """The agreed session id of (root, world size), if any yet."""
        with self._lock:
            return self._sessions.get(key)

    def set_session(self, key: Tuple[str, int], s: str) -> None:
        """Record the session id the ranks agreed on for (root, world size)."""
        with self._lock:
            self._sessions[key] = s

    def new_scratch(self) -> str:
        """A new scratch directory, removed at exit."""
        scratch = tempfile.mkdtemp(prefix="shmckpt-dcp-scratch-")
        with self._lock:
            self._scratch.append(scratch)
        return scratch

    def remove_scratch(self) -> None:
        """Remove every scratch directory made so far."""
        with self._lock:
            dirs = list(self._scratch)
            self._scratch.clear()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


#: The process's one :class:`BucketSession`.
BUCKETS = BucketSession()


def is_remote(path: Union[str, os.PathLike, None]) -> bool:
    """Whether a checkpoint path names a bucket (``s3://...``)."""
    return isinstance(path, str) and path.startswith("s3://")


def norm(path: Union[str, os.PathLike]) -> str:
    """A checkpoint path as the writer and reader keep it: an ``s3://`` URL unchanged
    (checked: see :func:`split`), a local path made absolute."""
    if is_remote(path):
        split(str(path))
        return str(path).rstrip("/")
    return os.path.abspath(os.fspath(path))


def split(url: str) -> Tuple[str, int]:
    """``s3://bucket/prefix/step-N`` -> (``s3://bucket/prefix``, ``N``)."""
    u = url.rstrip("/")
    root, _, last = u.rpartition("/")
    m = _STEP_RE.fullmatch(last)
    if not m or not root.startswith("s3://") or len(root) <= len("s3://") or int(m.group(1)) >= 1 << 64:
        raise ConfigError(
            f"{url!r}: a DCP checkpoint in a bucket is named s3://bucket/prefix/step-N "
            "(step N of the bucket root s3://bucket/prefix)"
        )
    return root, int(m.group(1))


def bucket(root: str) -> Any:
    """The open bucket of ``root`` (``_shmckpt.Bucket``), opened once per process."""
    return BUCKETS.bucket(root)


def check_target(url: str) -> None:
    """Refuse to save to a step already committed in the bucket (as a local checkpoint
    directory that exists is refused)."""
    root, step = split(url)
    if step in bucket(root).list():
        raise FileExistsError(
            f"{url}: this step is already committed in the bucket; ShmckptWriter never "
            "overwrites a checkpoint"
        )


def agree_session(root: str, world: int, gather_group: Callable[[], Any]) -> Optional[str]:
    """The session id of this run's saves to ``root``: chosen by the group's first rank
    and broadcast (on the gloo group ``gather_group()`` makes: the writer's session's) at the
    first save of every rank; ``None`` on one rank."""
    if world <= 1:
        return None
    key = (root, world)
    s = BUCKETS.session(key)
    if s is not None:
        return s
    import torch.distributed as dist

    g = gather_group()
    obj = [uuid.uuid4().hex if dist.get_rank(g) == 0 else None]
    dist.broadcast_object_list(obj, src=dist.get_global_rank(g, 0), group=g)
    s = str(obj[0])
    BUCKETS.set_session(key, s)
    return s


def engine_root(root: str, world: int) -> Tuple[str, Dict[str, Any]]:
    """A new scratch directory for a remote-only engine of bucket root ``root``, and the
    engine's remote settings."""
    scratch = BUCKETS.new_scratch()
    return scratch, dict(remote=root, remote_only=True, session=BUCKETS.session((root, world)))


atexit.register(BUCKETS.remove_scratch)  # registered before dcp.release: runs after it


def wait_committed(handle: Any) -> Dict[str, Any]:
    """Wait until this rank's save is committed in the bucket (every rank's object
    uploaded, ``manifest.json`` created); raises ``RemoteFailed`` when its upload failed."""
    return handle.wait_remote()


def storage_entries(url: str, results: Any, info_type: Any) -> Dict[Any, Any]:
    """DCP's storage entries of a save committed at ``url``: each ``WriteResult``'s
    ``storage_data`` given its offset, length and CRC-32C from the bucket's manifest."""
    import dataclasses

    root, step = split(url)
    m = json.loads(bucket(root).manifest(step))
    by_file: Dict[str, Dict[str, Tuple[int, int, int, int]]] = {}
    for f in m["files"]:
        by_file[f["file"]] = {
            t["name"]: (int(f["data_start"]), int(t["data_offsets"][0]), int(t["data_offsets"][1]), int(t["crc32c"]))
            for t in f["tensors"]
        }
    out: Dict[Any, Any] = {}
    for wr_list in results:
        for wr in wr_list:
            info = wr.storage_data
            ent = by_file.get(info.relative_path, {}).get(info.tensor)
            if ent is None:
                raise CorruptError(f"{url}/manifest.json: no tensor {info.tensor!r} in {info.relative_path}")
            start, b, e, crc = ent
            if not isinstance(info, info_type):
                raise CorruptError(f"{url}: a write result of {type(info).__name__}")
            out[wr.index] = dataclasses.replace(info, offset=start + b, length=e - b, crc32c=crc)
    return out


def publish_metadata(url: str, data: bytes) -> None:
    """Create ``.metadata`` beside committed step ``url`` (conditional create): the DCP
    checkpoint is complete from then on."""
    root, step = split(url)
    if not bucket(root).put_extra(step, METADATA_NAME, data):
        raise FileExistsError(f"{url}/{METADATA_NAME}: already exists; another save of this step finished first")


def read_metadata_bytes(url: str, cap: int) -> Any:
    """``.metadata`` of ``url`` (at most ``cap`` bytes) in an anonymous memory file
    (``memfd_create``: no disk needed), for the restricted unpickler (which reads an open
    file)."""
    root, step = split(url)
    got = bucket(root).get_extra(step, METADATA_NAME, cap)
    if got is None:
        raise FileNotFoundError(f"{url}/{METADATA_NAME}: no DCP metadata: not a checkpoint, or its save did not finish")
    f = os.fdopen(os.memfd_create("shmckpt-dcp-metadata", os.MFD_CLOEXEC), "w+b")
    f.write(got)
    f.seek(0)
    return f


def is_checkpoint(url: str, cap: int) -> bool:
    """Whether ``url`` holds a finished DCP checkpoint (its ``.metadata``, at most ``cap``
    bytes, is in the bucket)."""
    try:
        root, step = split(url)
        return bucket(root).get_extra(step, METADATA_NAME, cap) is not None
    except (ConfigError, NotFound, OSError):
        return False


class RankReader:
    """Reads rank objects of one committed step, each checked by Rust (size, header,
    every CRC-32C), in the shape of ``_shmckpt.read_rank_file``'s answer."""

    def __init__(self, url: str):
        self.url = url
        self.root, self.step = split(url)
        self._manifest: Optional[Dict[str, Any]] = None

    def read(self, rank: int) -> Tuple[str, Dict[str, str], List[Tuple[Any, ...]]]:
        """``(file, metadata, [(name, dtype, shape, crc32c, offset, nbytes, buffer)])``
        of ``rank``'s object; offsets are in the object, as in the DCP metadata."""
        b = bucket(self.root)
        if self._manifest is None:
            self._manifest = json.loads(b.manifest(self.step))
        entry = next((f for f in self._manifest["files"] if int(f["rank"]) == rank), None)
        if entry is None:
            raise CorruptError(f"{self.url}/manifest.json: no file for rank {rank}")
        _step, _url, meta, tensors = b.load(self.step, rank)
        by_name = {t["name"]: t for t in entry["tensors"]}
        out = []
        start = int(entry["data_start"])
        for name, dtype, shape, buf in tensors:
            t = by_name.get(name)
            if t is None:  # pragma: no cover - Rust loads exactly the manifest's tensors
                raise CorruptError(f"{self.url}/{entry['file']}: tensor {name!r} is not in the manifest")
            b0, e0 = int(t["data_offsets"][0]), int(t["data_offsets"][1])
            out.append((name, dtype, list(shape), int(t["crc32c"]), start + b0, e0 - b0, buf))
        return str(entry["file"]), dict(meta), out
