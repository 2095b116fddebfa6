"""``shmckpt://``: an fsspec protocol that reads checkpoints of
``shmckpt.lightning.ShmckptCheckpointIO`` as ``torch.save`` streams, so that Lightning's
own loaders read them unchanged::

    model = MyModel.load_from_checkpoint("shmckpt:///ckpt/run1/last.ckpt")
    with fsspec.open("shmckpt:///ckpt/run1/last.ckpt", "rb") as f:
        ckpt = torch.load(f)                       # weights_only=True works

``shmckpt:///DIR/NAME.ckpt`` (three slashes: an absolute path; ``shmckpt://rel/x`` is
relative to the working directory) names what the plugin saved as ``DIR/NAME.ckpt``; a
``step-N`` directory and a regular ``torch.save`` file are read too. The wheel registers
the protocol with fsspec (entry point ``fsspec.specs``); importing ``shmckpt.lightning``
registers it as well. Read-only: opening for writing is a ``PermissionError`` naming the
path (save through the plugin). See ``docs/lightning.md``.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import IO, Any, Dict, List, Optional, Union

from fsspec.spec import AbstractFileSystem
from fsspec.utils import stringify_path

from . import _named
from .errors import UnsafePath

__all__ = ["ShmckptFileSystem"]

PROTOCOL = "shmckpt"


class ShmckptFileSystem(AbstractFileSystem):
    """The ``shmckpt://`` fsspec protocol (see the module's documentation): ``open(path,
    "rb")`` gives the checkpoint as a ``torch.save`` stream, ``info``/``ls``/``exists``
    describe checkpoints as files; anything that writes is refused."""

    protocol = PROTOCOL
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        p = stringify_path(path)
        for prefix in (f"{PROTOCOL}://", f"{PROTOCOL}:"):
            if p.startswith(prefix):
                p = p[len(prefix) :]
                break
        return os.path.abspath(p) if p else os.getcwd()

    def _info(self, p: str) -> Dict[str, Any]:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "No such checkpoint", p) from None
        try:
            n = _named.named(p)
        except UnsafePath:
            n = None  # a name shmckpt keeps for itself: described as what it is
        if n is not None:
            d, step, _reserved = n
            sdir = os.path.join(d, f"step-{step}")
            size = 0
            if os.path.isdir(sdir) and not os.path.islink(sdir):
                for e in os.scandir(sdir):
                    if e.is_file(follow_symlinks=False):
                        size += e.stat(follow_symlinks=False).st_size
            # size: the bytes stored in step-N (the torch.save stream is built when opened).
            return {"name": p, "size": size, "type": "file", "step": step}
        if stat.S_ISLNK(st.st_mode):
            try:
                st = os.stat(p)
            except OSError:
                raise FileNotFoundError(errno.ENOENT, "A dangling link", p) from None
        if stat.S_ISDIR(st.st_mode):
            return {"name": p, "size": 0, "type": "directory"}
        if stat.S_ISREG(st.st_mode):
            return {"name": p, "size": st.st_size, "type": "file"}
        return {"name": p, "size": 0, "type": "other"}

    def info(self, path: Any, **kwargs: Any) -> Dict[str, Any]:
        return self._info(self._strip_protocol(path))

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> Union[List[Dict[str, Any]], List[str]]:
        p = self._strip_protocol(path)
        info = self._info(p)
        if info["type"] != "directory":
            out = [info]
        else:
            out = []
            for name in sorted(os.listdir(p)):
                if name.startswith(".shmckpt"):
                    continue  # shmckpt's own bookkeeping, never a checkpoint
                try:
                    out.append(self._info(os.path.join(p, name)))
                except FileNotFoundError:
                    continue  # removed meanwhile
        return out if detail else [i["name"] for i in out]

    def _open(
        self,
        path: Any,
        mode: str = "rb",
        block_size: Optional[int] = None,
        autocommit: bool = True,
        cache_options: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
    ) -> IO[bytes]:
        p = self._strip_protocol(path)
        if mode != "rb":
            raise PermissionError(
                errno.EACCES,
                f"shmckpt:// is read-only (mode {mode!r}): save through "
                "shmckpt.lightning.ShmckptCheckpointIO or shmckpt.Checkpointer",
                p,
            )
        return _named.torch_stream(p)

    def _refuse(self, path: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(
            errno.EACCES,
            "shmckpt:// is read-only: remove or write checkpoints through "
            "shmckpt.lightning.ShmckptCheckpointIO or shmckpt.Checkpointer",
            str(path),
        )

    rm_file = _refuse
    _rm = _refuse
    rm = _refuse
    mv = _refuse
    cp_file = _refuse
    touch = _refuse
    pipe_file = _refuse
    put_file = _refuse
