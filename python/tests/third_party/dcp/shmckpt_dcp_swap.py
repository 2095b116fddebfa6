"""A pytest plugin that runs PyTorch DCP's own storage tests (an upstream checkout of
pytorch/pytorch, ``test/distributed/checkpoint/test_file_system_checkpoint_cpu.py``; none
of their code is in this repository) with ``ShmckptWriter`` and ``ShmckptReader`` in place
of DCP's ``FileSystemWriter`` and ``FileSystemReader``, so that DCP's tests, unchanged,
decide. shmckpt's own file; see README.md beside it. Loaded with ``-p shmckpt_dcp_swap``
(this directory on ``PYTHONPATH``), as ``python/tests/test_upstream_dcp.py`` does::

    PYTHONPATH=python:python/tests/third_party/dcp python -m pytest -p shmckpt_dcp_swap \
        -p no:cacheprovider CHECKOUT/test/distributed/checkpoint/test_file_system_checkpoint_cpu.py

- The swap (``shmckpt_dcp_swap``, autouse, per test with ``monkeypatch``): ``PATCHES``
  names every place the two classes are looked up: ``torch.distributed.checkpoint`` and
  ``torch.distributed.checkpoint.filesystem`` (the tests import them from there),
  ``torch.distributed.checkpoint._storage_utils`` (``save``/``load`` given only a
  ``checkpoint_id`` pick the writer there), and the test module's own globals (bound when
  it was imported). The ranks that DCP's multi-process test cases spawn are fresh
  interpreters that import the test module to find the test class: for the test, the
  fixture puts ``rank_site/`` on their ``PYTHONPATH``, whose ``sitecustomize.py`` installs
  the swap (``install()``) when ``RANKS_ENV`` is set, before the test module binds the
  classes. The ranks' spool is the test's ``tmp_path`` (DCP's tests save into ``tempfile``
  directories, whose parent is the shared ``/tmp``).
- After a passing test, the fixture checks from the swap's log that every process that
  ran it (pytest's, or each spawned rank) made its writers and readers through the swap:
  a rank that kept DCP's own classes would pass silently otherwise.
- ``XFAIL``: the tests that fail for a reason inherent to shmckpt's design are
  ``xfail(strict=True, raises=NotImplementedError)`` with that reason: a listed test that
  passes, or fails any other way, fails the run. ``SKIP_IF``: tests the installed torch
  cannot run (a checkout newer than the torch), skipped with the reason while the
  capability is missing. ``DESELECTED``: what is left out of the default run, and why
  (``SHMCKPT_DCP_ALL=1`` runs it too).
- ``torch.testing._internal.common_utils`` (which DCP's test file imports) calls
  ``torch.backends.disable_global_flags()`` at import; the flags are unfrozen after
  collection, so that other tests of the session (Lightning's Trainer sets
  ``torch.backends.cudnn.benchmark``) can set them.

The replacements take FileSystemWriter's and FileSystemReader's constructor arguments;
what has no equivalent in shmckpt fails loudly (a storage extension), never silently.
Each one made appends ``PID writer`` or ``PID reader`` to the file named by ``RANKS_ENV``
(when set). ``SHMCKPT_DCP_SWAP=0`` runs the tests as PyTorch ships them (no swap, no
xfail): the baseline the differences are measured against.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint._storage_utils as storage_utils
import torch.distributed.checkpoint.filesystem as filesystem

from shmckpt import Tuning
from shmckpt.dcp import ShmckptReader, ShmckptWriter

#: Set by the fixture for the duration of a test: the file each writer and reader made
#: is logged to; the spawned ranks install the swap when they see it.
RANKS_ENV = "SHMCKPT_DCP_SWAP_LOG"
#: The spool of every swapped writer (the test's own directory), set by the fixture:
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
            tuning=Tuning(chunk_size=1 << 20, writer_threads=max(1, int(thread_count))),
        )


class SwappedReader(ShmckptReader):
    """``FileSystemReader(path, _extension_registry)``, read by ShmckptReader."""

    def __init__(self, path: Union[str, os.PathLike], _extension_registry: Any = None, **kwargs: Any) -> None:
        _log("reader")
        super().__init__(path)


#: (module, attribute, replacement) for the modules of DCP; the fixture adds the test
#: module's globals.
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


#: The directory whose ``sitecustomize.py`` installs the swap in the spawned ranks.
RANK_SITE = Path(__file__).resolve().parent / "rank_site"

SWAPPED = os.environ.get("SHMCKPT_DCP_SWAP", "1") != "0"
RUN_ALL = os.environ.get("SHMCKPT_DCP_ALL", "0") == "1"

_FILE = "test_file_system_checkpoint_cpu.py"

ROT13 = (
    "storage extensions (_extensions=[Rot13Example()]): a rank file of ShmckptWriter is plain "
    "safetensors; no per-item transform is applied or recorded (the swapped writer refuses an "
    "extension with NotImplementedError rather than ignore it)"
)
ZSTD = (
    "storage extensions (_extensions=[ZStandard()]): no compression of items; the file is "
    "plain safetensors that other readers map directly (refused with NotImplementedError)"
)

#: DCP's tests that fail with the swap, by id (``dcp_id``), and why.
XFAIL: Dict[str, str] = {
    f"{_FILE}::TestDistributedStateDictSaveLoadRot13::test_read_write_tensor_and_blob_thread_count_1": ROT13,
    f"{_FILE}::TestDistributedStateDictSaveLoadRot13::test_read_write_tensor_and_blob_thread_count_2": ROT13,
    f"{_FILE}::TestDistributedStateDictSaveLoadZStandard::test_read_write_only_tensor_thread_count_1": ZSTD,
    f"{_FILE}::TestDistributedStateDictSaveLoadZStandard::test_read_write_only_tensor_thread_count_2": ZSTD,
}


def _lacks_allow_unsafe_types() -> bool:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    return "allow_unsafe_types" not in inspect.signature(DefaultLoadPlanner.__init__).parameters


#: id -> (condition, reason): skipped while the condition holds (checked at collection).
SKIP_IF: Dict[str, Tuple[Callable[[], bool], str]] = {
    f"{_FILE}::TestDistributedStateDictSaveLoad::test_dtype_mismatch_casting": (
        _lacks_allow_unsafe_types,
        "the test file is newer than the installed torch (the recorded run: pytorch "
        "02dee1ad): DefaultLoadPlanner(allow_unsafe_types=...) does not exist here (it fails "
        "the same way with DCP's own FileSystemWriter)",
    ),
}

#: Left out of the default run (SHMCKPT_DCP_ALL=1 runs them): id suffix -> why.
DESELECTED: Dict[str, str] = {
    "_thread_count_2": (
        "the thread_count=2 copy of each test only sets ShmckptWriter's writer threads (the "
        "engine's own tests cover them); each multi-rank copy costs ~10 s of spawning ranks"
    ),
}

# torch.testing._internal.common_utils (which DCP's test file imports) calls
# torch.backends.disable_global_flags() at import; the rest of the session (Lightning's
# Trainer sets torch.backends.cudnn.benchmark) must not see it: restored after collection.
_FLAGS_FROZEN = torch.backends.flags_frozen()


def dcp_id(item: Any) -> Optional[str]:
    """``test_file_system_checkpoint_cpu.py::Class::test_y``: the file's name and the rest
    of the node id, wherever the checkout is; None for any other test."""
    path = Path(str(item.path))
    if path.name != _FILE:
        return None
    return "::".join([path.name] + item.nodeid.split("::")[1:])


def pytest_collection_modifyitems(config: Any, items: List[Any]) -> None:
    # This hook sees every item of the session: only DCP's tests are touched.
    keep, drop = [], []
    for item in items:
        vid = dcp_id(item)
        if vid is None:
            keep.append(item)
            continue
        if not RUN_ALL and any(vid.endswith(s) for s in DESELECTED):
            drop.append(item)
            continue
        keep.append(item)
        skip = SKIP_IF.get(vid)
        if skip is not None and skip[0]():
            item.add_marker(pytest.mark.skip(reason=skip[1]))
        reason = XFAIL.get(vid) if SWAPPED else None
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True, raises=NotImplementedError))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session: Any) -> None:
    if not _FLAGS_FROZEN and torch.backends.flags_frozen():
        # The flag is a global of torch/backends/__init__.py, which torch wraps in another
        # module object: set it where disable_global_flags() set it.
        torch.backends.disable_global_flags.__globals__["__allow_nonbracketed_mutation_flag"] = True
        assert not torch.backends.flags_frozen()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.shmckpt_call = rep


@pytest.fixture(autouse=True)
def shmckpt_dcp_swap(request: Any, monkeypatch: Any, tmp_path: Path) -> Any:
    """The swap for one of DCP's tests: DCP's modules and the test module's globals, and,
    through the environment, the ranks it spawns (``rank_site/sitecustomize.py``); their
    spool is this test's directory. After a passing test: every process that ran it made
    its writers and readers through the swap."""
    if not SWAPPED or dcp_id(request.node) is None:
        yield
        return
    log = tmp_path / "swap.log"
    log.touch()
    monkeypatch.setenv(RANKS_ENV, str(log))
    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "spool"))
    # The spawned ranks run rank_site/sitecustomize.py at start-up, before they import the
    # test module; it imports this module from the directory beside it.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(RANK_SITE), os.environ.get("PYTHONPATH")])))
    for mod, name, new in PATCHES:
        monkeypatch.setattr(mod, name, new)
    module = request.module
    monkeypatch.setattr(module, "FileSystemWriter", SwappedWriter)
    monkeypatch.setattr(module, "FileSystemReader", SwappedReader)
    assert installed(module)
    yield
    rep: Optional[Any] = getattr(request.node, "shmckpt_call", None)
    if rep is None or not rep.passed:
        return
    made: Dict[str, set] = {"writer": set(), "reader": set()}
    for line in log.read_text().splitlines():
        pid, kind = line.split()
        made[kind].add(int(pid))
    instance = getattr(request.node, "instance", None)
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    if isinstance(instance, MultiProcessTestCase):
        want = instance.world_size
        assert os.getpid() not in made["writer"] | made["reader"]
    else:
        want = 1
        assert made["writer"] <= {os.getpid()} and made["reader"] <= {os.getpid()}
    assert len(made["writer"]) == want and len(made["reader"]) == want, (
        f"{want} process(es) ran the test, but ShmckptWriter was made in {len(made['writer'])} "
        f"and ShmckptReader in {len(made['reader'])}: a process kept DCP's FileSystemWriter/Reader"
    )
