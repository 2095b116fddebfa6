"""Lightning's own checkpoint tests with ``ShmckptCheckpointIO`` swapped in, from an
upstream checkout the user provides (none of Lightning's code is in this repository):
``SHMCKPT_LIGHTNING_TESTS`` names a checkout of Lightning-AI/pytorch-lightning at tag
2.6.5 (its root, ``tests/`` or ``tests/tests_pytorch/``; ``scripts/upstream_tests.sh``
makes one in ``target/upstream/``). The files of ``shmckpt_swap.FILES`` run in a pytest
subprocess with the plugin ``python/tests/third_party/lightning/shmckpt_swap.py``; the
outcome counts must be those recorded (``EXPECTED``), so no test fails, none that is
listed xfail passes (strict) and none is newly skipped.

Without the variable the test is skipped (CI has no GitHub access);
``SHMCKPT_REQUIRE_UPSTREAM_TESTS=1`` makes that a failure.
"""

import pathlib

import pytest

import upstream_support

PLUGIN_DIR = upstream_support.THIRD_PARTY / "lightning"
ENV = "SHMCKPT_LIGHTNING_TESTS"
HOW = (
    "Run scripts/upstream_tests.sh on a machine with GitHub access (it clones "
    "Lightning-AI/pytorch-lightning at tag 2.6.5, tests/tests_pytorch only, into "
    "target/upstream/pytorch-lightning), or set SHMCKPT_LIGHTNING_TESTS to such a checkout."
)
#: The files (shmckpt_swap.FILES, relative to tests/tests_pytorch).
FILES = (
    "plugins/test_checkpoint_io_plugin.py",
    "checkpointing/test_checkpoint_callback_frequency.py",
    "checkpointing/test_model_checkpoint.py",
    "checkpointing/test_torch_saving.py",
    "checkpointing/test_trainer_checkpoint.py",
    "trainer/connectors/test_checkpoint_connector.py",
)
#: The recorded run (Lightning 2.6.5's tests, lightning 2.6.6 installed): 101 xfails, each
#: with its reason (shmckpt_swap.XFAIL); 5 skipped by Lightning's own RunIf (2 GPUs,
#: standalone runs, omegaconf).
EXPECTED = {"passed": 73, "xfailed": 101, "skipped": 5}


def _tests_pytorch(root: pathlib.Path) -> pathlib.Path:
    for candidate in (root / "tests" / "tests_pytorch", root / "tests_pytorch", root):
        if candidate.name == "tests_pytorch" and (candidate / "conftest.py").is_file():
            return candidate
    pytest.fail(f"{ENV}={root}: no tests/tests_pytorch/conftest.py there (a checkout of Lightning at tag 2.6.5?)")


def test_shmckpt_swap_lists_the_files():
    """The runner and the plugin name the same files."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("shmckpt_swap_files", PLUGIN_DIR / "shmckpt_swap.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.FILES == FILES
    assert {k.split("::")[0] for k in module.XFAIL} <= set(FILES)
    assert len(module.XFAIL) == EXPECTED["xfailed"]


@pytest.mark.slow
def test_lightning_checkpoint_tests_with_shmckpt_checkpoint_io(tmp_path):
    tests = _tests_pytorch(upstream_support.checkout(ENV, HOW))
    missing = [f for f in FILES if not (tests / f).is_file()]
    assert not missing, f"{ENV}: the checkout lacks {missing}"
    upstream_support.require_modules(["cloudpickle", "jsonargparse", "tensorboard"], "Lightning's tests")
    run = upstream_support.run_pytest(
        [tests / f for f in FILES],
        plugin="shmckpt_swap",
        plugin_dir=PLUGIN_DIR,
        rootdir=tests,
        tmp_path=tmp_path,
        env={"SHMCKPT_LIGHTNING_SWAP": "1"},
        timeout=1800,
    )
    print(f"Lightning's tests with the plugin: {run.counts} in {run.seconds:.0f} s")
    assert run.counts == EXPECTED, f"{run.counts} != {EXPECTED}:\n{run.output[-6000:]}"
