"""shmckpt's conftest for PyTorch DCP's vendored tests (not a PyTorch file; ../README.md).

- Every test of this directory runs with ``ShmckptWriter``/``ShmckptReader`` in place of
  DCP's ``FileSystemWriter``/``FileSystemReader`` (``shmckpt_swap.py``), in pytest's
  process and in every rank a multi-process test case spawns; a test that passes must
  have made its writers and readers through the swap in each of its processes (checked
  after it, from the swap's log), so a rank that silently kept DCP's own classes fails.
- ``XFAIL``: the tests that fail for a reason inherent to shmckpt's design are
  ``xfail(strict=True, raises=NotImplementedError)`` with that reason: a listed test that
  passes, or fails any other way, fails the run.
- ``SKIP_IF``: tests the installed torch cannot run (the vendored file is a newer
  revision), skipped with the reason while the capability is missing.
- ``DESELECTED``: what is left out of the default run, and why (``SHMCKPT_DCP_ALL=1``
  runs it too).

``SHMCKPT_DCP_SWAP=0`` runs the tests as PyTorch ships them (no swap, no xfail): the
baseline the differences are measured against.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

from dcp_tests import shmckpt_swap

_ROOT = Path(__file__).parent
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

#: DCP's tests that fail with the swap, by id relative to this directory, and why.
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
        "the vendored file (pytorch 02dee1ad) is newer than the installed torch: "
        "DefaultLoadPlanner(allow_unsafe_types=...) does not exist here (it fails the same "
        "way with DCP's own FileSystemWriter)",
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


def _vendored(item: Any) -> bool:
    return Path(str(item.path)).is_relative_to(_ROOT)


def _vendored_id(item: Any) -> str:
    """``test_x.py::Class::test_y``: the id relative to this directory."""
    return "::".join([Path(str(item.path)).relative_to(_ROOT).as_posix()] + item.nodeid.split("::")[1:])


def pytest_collection_modifyitems(config: Any, items: List[Any]) -> None:
    # This hook sees every item of the session: only DCP's tests are touched.
    keep, drop = [], []
    for item in items:
        if not _vendored(item):
            keep.append(item)
            continue
        vid = _vendored_id(item)
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
    """The swap for one test: DCP's modules and the test module's globals, and, through
    the environment, the ranks it spawns (``dcp_tests/__init__.py``); their spool is this
    test's directory. After a passing test: every process that ran it made its writers
    and readers through the swap."""
    if not SWAPPED:
        yield
        return
    log = tmp_path / "swap.log"
    log.touch()
    monkeypatch.setenv(shmckpt_swap.RANKS_ENV, str(log))
    monkeypatch.setenv(shmckpt_swap.SPOOL_ENV, str(tmp_path / "spool"))
    for mod, name, new in shmckpt_swap.PATCHES:
        monkeypatch.setattr(mod, name, new)
    module = request.module
    monkeypatch.setattr(module, "FileSystemWriter", shmckpt_swap.SwappedWriter)
    monkeypatch.setattr(module, "FileSystemReader", shmckpt_swap.SwappedReader)
    assert shmckpt_swap.installed(module)
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
