"""A checkpoint that ``shmckpt.lightning.ShmckptCheckpointIO`` saved, read by its path
without Lightning: ``DIR/NAME.ckpt`` (a link to ``DIR/step-N``, or the reservation of a
save not published yet) or ``DIR/step-N`` itself.

:func:`load_step` rebuilds the checkpoint dict from the committed files (typed JSON and
tensors, no pickle); :func:`torch_stream` gives it as a ``torch.save`` byte stream, what
``torch.load`` and Lightning's own loaders read (``shmckpt.fs.ShmckptFileSystem``, the
``shmckpt://`` protocol, serves it). Used by ``shmckpt.lightning`` and ``shmckpt.fs``.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from typing import IO, Any, Dict, Optional, Tuple

import numpy as np

from . import _shmckpt, _state
from .checkpointer.load import _finish_tensor, _torch_dtype_for
from .errors import CorruptError, NotFound, UnsafePath

#: Metadata key recording the Lightning file name a shmckpt step was saved for.
PATH_KEY = "lightning.path"

#: ``scheme://`` at the start of a path: a URL (``s3://``, ``memory://``, any fsspec one).
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

#: URL schemes that name a local path: ``file://`` and ``shmckpt://`` (this format, read
#: through ``shmckpt.fs``).
LOCAL_SCHEMES = ("file", "shmckpt")

#: A committed step directory's name.
_STEP_DIR = re.compile(r"^step-(0|[1-9][0-9]{0,18})$")

#: ``torch_stream`` keeps a stream up to this size in memory, a larger one in a temporary
#: file of ``$TMPDIR`` (deleted when closed).
SPOOL_IN_MEMORY = 64 << 20


def local_path(path: Any, who: str = "ShmckptCheckpointIO") -> str:
    """The absolute local path of a checkpoint path. A URL of another scheme is refused
    (``ValueError`` naming it): it is never taken for a local path (``s3://b/x`` is not
    ``./s3:/b/x``). ``file://`` and ``shmckpt://`` URLs are local paths."""
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    m = _URL.match(p)
    if m is not None:
        if m.group(1).lower() not in LOCAL_SCHEMES:
            raise ValueError(
                f"{who}: {p!r} is a {m.group(1)}:// URL; this plugin saves to a "
                "local directory only (give ModelCheckpoint a local dirpath, or use Lightning's "
                "own CheckpointIO for remote storage)"
            )
        p = p[m.end() :]
    return os.path.abspath(p)


def named(p: str) -> Optional[Tuple[str, int, Optional[str]]]:
    """``(directory, step, reserved)`` when the absolute path ``p`` names a checkpoint of
    ``ShmckptCheckpointIO``: a name it published (a link leading to ``step-N``: ``reserved``
    is ``None``), a name it reserved for a save not published yet (``reserved`` is that
    name) or a committed ``step-N`` directory; ``None`` for anything else (a missing path, a
    regular file, another directory). A name shmckpt keeps for itself (``.shmckpt*``) is
    ``shmckpt.UnsafePath``."""
    d, name = os.path.split(p)
    m = _STEP_DIR.match(name)
    if m is not None:
        if os.path.isdir(p) and not os.path.islink(p):
            return d, int(m.group(1)), None
        return None
    r = _shmckpt.resolve_name(d, name)
    if r is None:
        return None
    step, reserved = r
    return d, step, reserved


def load_step(d: str, step: int, reserved: Optional[str] = None) -> Any:
    """The nested state of committed checkpoint ``d/step-N`` (rank 0 of 1), read without an
    engine (so without the root's rank lock: every process of a DDP job can load at once),
    header checked against the manifest and every CRC-32C verified. The manifest must be
    of ``step`` (the step the link names): a step directory replaced by a copy of another
    step is a ``CorruptError`` naming both. ``reserved``: the name reserved for ``step``
    by a save that was not published; the step must exist and have been saved for that
    name (else ``NotFound``). Tensors are CPU tensors backed by the buffers read (no copy)."""
    sdir = os.path.join(d, f"step-{step}")
    if os.path.islink(sdir) or not os.path.isdir(sdir):
        if reserved is not None:
            raise NotFound(
                f"{os.path.join(d, reserved)}: reserved for step {step} by a save that was never "
                f"committed (its process ended before the checkpoint was durable); {sdir} does not exist",
                path=os.path.join(d, reserved),
                step=step,
            )
        raise NotFound(f"{sdir}: not a checkpoint directory (a link or missing)", path=sdir, step=step)
    file, meta, tensors = _shmckpt.read_rank_file(sdir, 0, step=step)
    if reserved is not None and meta.get(PATH_KEY) != reserved:
        raise NotFound(
            f"{os.path.join(d, reserved)}: reserved for step {step} by a save that was never committed; "
            f"{sdir} was saved for {meta.get(PATH_KEY)!r}",
            path=os.path.join(d, reserved),
            step=step,
        )
    header = _shmckpt.rank_file_metadata(sdir, 0, step=step)
    objs = {name: (dtype, shape, buf) for name, dtype, shape, _crc, _off, _n, buf in tensors}
    text = header.get(_state.STATE_KEY)
    import torch

    def tensor(name: str, node: Optional[Dict[str, Any]]) -> Any:
        if name not in objs:
            raise ValueError(f"tensor {name!r} is not in the file")
        dtype, shape, buf = objs[name]
        if node is not None and node.get("t") == "ndarray":
            ndt = np.dtype(str(node.get("dtype")))
            if _state.NUMPY_TO_ST.get(ndt) != dtype:
                raise ValueError(f"array {name!r}: numpy dtype {ndt} does not match the file")
            a = np.asarray(buf) if buf is not None and len(buf) else np.empty(0, dtype=np.uint8)
            return a.view(ndt).reshape(shape) if a.size else np.empty(shape, dtype=ndt)
        tdt = _torch_dtype_for(node, dtype)
        if buf is None or len(buf) == 0:
            return torch.empty(shape, dtype=tdt)
        return torch.from_numpy(np.asarray(buf)).view(tdt).reshape(shape)

    if text is None:
        return {name: tensor(name, None) for name in objs}
    made: Dict[str, Any] = {}

    def lookup(node: Dict[str, Any]) -> Any:
        name = node.get("alias") or node["n"]
        if name not in made:
            made[name] = _finish_tensor(tensor(name, node), node)
        return made[name]

    try:
        return _state.unflatten(_state.decode(text), lookup)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        raise CorruptError(f"{sdir}: the {_state.STATE_KEY} metadata does not describe the file: {e}") from None


def not_a_checkpoint(p: str) -> OSError:
    """The error for an existing path that is neither a checkpoint of the plugin nor a
    regular file: ``IsADirectoryError`` for a directory (as ``open`` would raise, but
    saying what to give instead), else ``shmckpt.UnsafePath`` (a link that does not lead
    to a ``step-N`` beside it is never followed)."""
    if os.path.isdir(p) and not os.path.islink(p):
        return IsADirectoryError(
            errno.EISDIR,
            "a directory, not a checkpoint of ShmckptCheckpointIO (give its NAME.ckpt link "
            "or a step-N directory) nor a torch.save file",
            p,
        )
    return UnsafePath(f"{p}: not a checkpoint of ShmckptCheckpointIO (a link to step-N) nor a file", path=p)


def load_path(path: Any) -> Optional[Dict[str, Any]]:
    """The checkpoint dict saved as ``path`` by the plugin (a ``NAME.ckpt`` it published or
    reserved, or a ``step-N`` directory), every CRC-32C verified; ``None`` when ``path`` is
    a regular file (a ``torch.save`` checkpoint: the caller reads it). ``FileNotFoundError``
    when it does not exist; :func:`not_a_checkpoint` for anything else."""
    p = local_path(path)
    if not os.path.lexists(p):
        raise FileNotFoundError(errno.ENOENT, "Checkpoint file not found", p)
    n = named(p)
    if n is None:
        if os.path.isfile(p) and not os.path.islink(p):
            return None
        raise not_a_checkpoint(p)
    state = load_step(*n)
    if not isinstance(state, dict):
        raise CorruptError(f"{p}: the checkpoint is a {type(state).__name__}, not a dict", path=p)
    return state


def torch_stream(path: Any) -> IO[bytes]:
    """The checkpoint saved as ``path`` as a ``torch.save`` byte stream, open for reading
    at its start: what ``torch.load`` reads (with ``weights_only=True``: only tensors,
    arrays and plain values are in it). A regular file (a ``torch.save`` checkpoint) is
    opened as it is. The stream is built when called: kept in memory up to
    ``SPOOL_IN_MEMORY`` bytes, in an unnamed temporary file of ``$TMPDIR`` above that."""
    state = load_path(path)
    if state is None:
        return open(local_path(path), "rb")
    import torch

    f = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY, mode="w+b")
    try:
        torch.save(state, f)
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f  # type: ignore[return-value]
