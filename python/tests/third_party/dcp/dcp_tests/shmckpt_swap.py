"""shmckpt's addition to PyTorch DCP's tests (not a PyTorch file): ``ShmckptWriter`` and
``ShmckptReader`` in place of DCP's ``FileSystemWriter`` and ``FileSystemReader``, so that
DCP's own storage tests, unchanged, decide (see ../README.md).

``PATCHES`` names every place the two classes are looked up: ``torch.distributed.checkpoint``
and ``torch.distributed.checkpoint.filesystem`` (the tests import them from there),
``torch.distributed.checkpoint._storage_utils`` (``save``/``load`` given only a
``checkpoint_id`` pick the writer there) and the test modules' own globals (bound when
they were imported). The conftest applies them per test with ``monkeypatch``, so no other
test of the session sees the swap. The ranks that DCP's multi-process test cases spawn
import ``dcp_tests`` before the test module, and ``dcp_tests/__init__.py`` installs the
swap there (``install()``) when ``RANKS_ENV`` is set, before the test module binds the
classes.

The replacements take FileSystemWriter's and FileSystemReader's constructor arguments;
what has no equivalent in shmckpt fails loudly (a storage extension), never silently.
Each one made appends ``PID writer`` or ``PID reader`` to the file named by ``RANKS_ENV``
(when set): the conftest checks that every process of a passing test used them.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint._storage_utils as storage_utils
import torch.distributed.checkpoint.filesystem as filesystem

from shmckpt.dcp import ShmckptReader, ShmckptWriter

#: Set by the conftest for the duration of a test: the file each writer and reader made
#: is logged to; the spawned ranks install the swap when they see it.
RANKS_ENV = "SHMCKPT_DCP_SWAP_LOG"
#: The spool of every swapped writer (the test's own directory), set by the conftest:
#: DCP's tests save into ``tempfile`` directories, whose parent is the shared ``/tmp``.
SPOOL_ENV = "SHMCKPT_DCP_SWAP_SPOOL"

#: The classes that are replaced (the tests' own subclasses of them would not be).
ORIGINAL = {"writer": filesystem.FileSystemWriter, "reader": filesystem.FileSystemReader}


def _log(kind: str) -> None:
    path = os.environ.get(RANKS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {kind}\n")


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
        _log("writer")
        if _extensions:
            raise NotImplementedError(
                f"ShmckptWriter has no storage extensions ({[type(e).__name__ for e in _extensions]}): "
                "its rank files are plain safetensors"
            )
        super().__init__(
            path,
            overwrite=overwrite,
            spool=os.environ.get(SPOOL_ENV) or None,
            chunk_size=1 << 20,
            writer_threads=max(1, int(thread_count)),
        )


class SwappedReader(ShmckptReader):
    """``FileSystemReader(path, _extension_registry)``, read by ShmckptReader."""

    def __init__(self, path: Union[str, os.PathLike], _extension_registry: Any = None, **kwargs: Any) -> None:
        _log("reader")
        super().__init__(path)


#: (module, attribute, replacement) for the modules of DCP; the conftest adds the test
#: modules' globals.
PATCHES: List[Tuple[Any, str, type]] = [
    (mod, name, new)
    for mod in (dcp, filesystem, storage_utils)
    for name, new in (("FileSystemWriter", SwappedWriter), ("FileSystemReader", SwappedReader))
]


def install() -> None:
    """The swap for the rest of this process (a spawned rank)."""
    for mod, name, new in PATCHES:
        setattr(mod, name, new)


def installed(module: Any = None) -> bool:
    """Whether DCP (and ``module``'s globals, when given) find the swapped classes."""
    mods = [dcp, filesystem, storage_utils] + ([module] if module is not None else [])
    return all(
        getattr(m, "FileSystemWriter", None) is SwappedWriter and getattr(m, "FileSystemReader", None) is SwappedReader
        for m in mods
    )
