"""ShmckptWriter and ShmckptReader in place of DCP's FileSystemWriter and FileSystemReader,
for running PyTorch DCP's own tests unchanged (see README.md in this directory).

``install()`` replaces the two classes where DCP's tests and DCP itself look them up:
``torch.distributed.checkpoint``, ``torch.distributed.checkpoint.filesystem`` (the
tests import them from both) and ``torch.distributed.checkpoint._storage_utils``
(``save``/``load`` given only a ``checkpoint_id`` pick the writer from there). The
replacements take FileSystemWriter's and FileSystemReader's constructor arguments;
what has no equivalent in shmckpt fails loudly (a storage extension), never silently.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint._storage_utils as storage_utils
import torch.distributed.checkpoint.filesystem as filesystem

from shmckpt.dcp import ShmckptReader, ShmckptWriter

#: The classes that were replaced (the tests' own subclasses of them are not).
ORIGINAL = {"writer": filesystem.FileSystemWriter, "reader": filesystem.FileSystemReader}


class SwappedWriter(ShmckptWriter):
    """``FileSystemWriter(path, single_file_per_rank, sync_files, thread_count,
    per_thread_copy_ahead, cache_staged_state_dict, overwrite, _extensions,
    serialization_format)``, written by ShmckptWriter. ``thread_count`` sets its writer
    threads; the layout and sync arguments have no counterpart (one safetensors file per
    rank, always durable); a storage extension (compression, a transform) is refused."""

    def __init__(
        self,
        path: Union[str, os.PathLike],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Optional[Sequence[Any]] = None,
        serialization_format: Any = None,
        **kwargs: Any,
    ) -> None:
        if _extensions:
            raise NotImplementedError(
                f"ShmckptWriter has no storage extensions ({[type(e).__name__ for e in _extensions]}): "
                "its rank files are plain safetensors"
            )
        super().__init__(path, overwrite=overwrite, chunk_size=1 << 20, writer_threads=max(1, int(thread_count)))


class SwappedReader(ShmckptReader):
    """``FileSystemReader(path, _extension_registry)``, read by ShmckptReader."""

    def __init__(self, path: Union[str, os.PathLike], _extension_registry: Any = None, **kwargs: Any) -> None:
        super().__init__(path)


def install() -> None:
    for mod in (dcp, filesystem, storage_utils):
        mod.FileSystemWriter = SwappedWriter  # type: ignore[misc,assignment]
        mod.FileSystemReader = SwappedReader  # type: ignore[misc,assignment]
