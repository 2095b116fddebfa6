"""A pytest plugin that runs Lightning's own checkpoint tests (an upstream checkout of
Lightning-AI/pytorch-lightning, ``tests/tests_pytorch``; none of their code is in this
repository) with ``shmckpt.lightning.ShmckptCheckpointIO`` as every Trainer's default
``CheckpointIO``. shmckpt's own file; see README.md beside it. Loaded with
``-p shmckpt_swap`` (this directory on ``PYTHONPATH``), as
``python/tests/test_upstream_lightning.py`` does::

    PYTHONPATH=python:python/tests/third_party/lightning python -m pytest -p shmckpt_swap \
        -p no:cacheprovider CHECKOUT/tests/tests_pytorch/checkpointing/test_model_checkpoint.py

What it does (Lightning's ``tests_pytorch/conftest.py`` is used as Lightning ships it):

- The swap (``shmckpt_checkpoint_io``, autouse): replaces the ``TorchCheckpointIO`` that
  ``Strategy.checkpoint_io`` creates when the Trainer was given none (Lightning's default
  for every strategy these tests use); a test that passes its own ``CheckpointIO`` keeps
  it. After the test, every plugin made is torn down (what Lightning does at the end of
  ``fit``; a test that only calls ``trainer.save_checkpoint`` has its saves committed and
  published here, and a save's error fails the test), before Lightning's thread check
  (the conftest's ``thread_police_duuu_daaa_duuu_daaa``) looks for threads left running.
- ``XFAIL``: the tests that still differ with the plugin are marked
  ``xfail(strict=True)`` with the reason: one that starts passing fails the run, so the
  list stays true.
- Lightning's deprecation warnings are errors in its tests (the conftest's own filter,
  applied here too so that it holds whatever the conftest does), and the ``flaky`` marker
  is registered (Lightning's CI reruns flaky tests with pytest-rerunfailures; here they
  run once).

The marks go to items under a ``tests_pytorch`` directory only; the fixture requests the
conftest's thread check, so run the plugin on Lightning's tests alone. ``SHMCKPT_LIGHTNING_SWAP=0``
runs the tests as Lightning ships them (no swap, no xfail): the baseline the differences
are measured against.
"""

import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

# The reasons: each is one of the differences docs/lightning.md lists ("Lightning's own
# tests"), inherent to the plugin's design, not a defect to fix here.
MOCK = (
    "counts torch.save calls (mock.patch('torch.save')): the plugin saves through shmckpt and never calls torch.save"
)
LIST = (
    "lists dirpath and expects only the checkpoint names: each name is a link to the step-N directory beside it, which the listing shows too"
)
LISTLOCK = (
    "lists dirpath while the plugin's engine is open (during fit, or after a save outside fit): besides each "
    "name's step-N directory, the engine's .shmckpt-rank-0.lock (teardown removes it; Lightning calls teardown "
    "at the end of fit, validate, test and predict only)"
)
PLAIN = (
    "opens the checkpoint by its plain path (os.path.isfile, torch.load or Lightning's _load): a plugin checkpoint is a link to a step-N directory (read it through shmckpt:// or convert it with to_torch_file)"
)
URL = (
    "a memory:// default_root_dir: the plugin saves to local directories only and refuses a URL with a ValueError"
)
STORAGE = (
    "Trainer.save_checkpoint(storage_options=...): the plugin supports no storage options (TypeError)"
)
DEFAULT = (
    "asserts that the default CheckpointIO is TorchCheckpointIO: the swap replaces exactly that default"
)

#: The Lightning tests that fail with the plugin swapped in, by id relative to
#: tests_pytorch/, and why. Every other test of ``FILES`` passes as it is (or is skipped by
#: Lightning's own ``RunIf``).
XFAIL: Dict[str, str] = {
    "checkpointing/test_checkpoint_callback_frequency.py::test_default_checkpoint_freq[1-1.0-1]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_default_checkpoint_freq[2-1.0-2]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_default_checkpoint_freq[1-0.25-4]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_default_checkpoint_freq[2-0.3-6]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[False-1-1-1.0-1]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[False-2-2-1.0-2]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[False-2-1-0.25-4]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[False-2-2-0.3-6]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[True-1-1-1.0-1]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[True-2-2-1.0-2]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[True-2-1-0.25-4]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[True-2-2-0.3-6]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[link-1-1-1.0-1]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[link-2-2-1.0-2]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[link-2-1-0.25-4]": MOCK,
    "checkpointing/test_checkpoint_callback_frequency.py::test_top_k[link-2-2-0.3-6]": MOCK,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt[False-False-False-val_log]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt[False-True-False-train_log_epoch]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt[False-False-True-val_log]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt[True-False-False-val_log]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt[True-True-False-train_log_epoch]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt[True-False-True-val_log]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt_val_check_interval[0.25-True-True]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt_val_check_interval[0.25-False-True]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt_val_check_interval[0.42-False-False]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_with_non_string_input[-1]": LIST,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_file_extension": LIST,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_save_last[True]": LIST,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_save_last[link]": LIST,
    "checkpointing/test_model_checkpoint.py::test_none_monitor_not_alternating": LISTLOCK,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_save_last_none_monitor": LIST,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_every_n_epochs[1]": LIST,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_every_n_epochs[2]": LIST,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_every_n_epochs[3]": LIST,
    "checkpointing/test_model_checkpoint.py::test_ckpt_every_n_train_steps": LIST,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_run_condition_on_train_batch_start": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelInTrainingStep]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelInValidationStep]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelBackward]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnBeforeBackward]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnAfterBackward]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnBeforeZeroGrad]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnFitEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnTrainEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnValidationStart]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnValidationEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnTrainBatchStart]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnTrainBatchEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnTrainEpochStart]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnTrainEpochEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnValidationBatchStart]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnValidationBatchEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnValidationEpochStart]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnValidationEpochEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnValidationModelEval]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnValidationModelTrain]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOnBeforeOptimizerStep]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelConfigureGradienClipping]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOptimizerStep]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized[TroubledModelOptimizerZeroGrad]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnFitEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnTrainBatchStart]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnTrainBatchEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnTrainEpochStart]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnTrainEpochEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnValidationEpochStart]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnValidationEpochEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnValidationBatchStart]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnValidationBatchEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnTrainEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnValidationStart]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubledCallbackOnValidationEnd]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubleCallbackOnBeforeBackward]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubleCallbackOnAfterBackward]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubleCallbackOnBeforeOptimizerStep]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks[TroubleCallbackOnBeforeZeroGrad]": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_train_time_interval": LIST,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_topk_zero": LIST,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_topk_all": LIST,
    "checkpointing/test_model_checkpoint.py::test_default_checkpoint_behavior": LIST,
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_save_last_checkpoint_contents": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_checkpoint_repeated_strategy": LIST,
    "checkpointing/test_model_checkpoint.py::test_checkpoint_repeated_strategy_extended": LIST,
    "checkpointing/test_model_checkpoint.py::test_val_check_interval_checkpoint_files": LIST,
    "checkpointing/test_model_checkpoint.py::test_current_score": PLAIN,
    "checkpointing/test_model_checkpoint.py::test_ckpt_version_after_rerun_new_trainer": LIST,
    "checkpointing/test_model_checkpoint.py::test_ckpt_version_after_rerun_same_trainer": LIST,
    "checkpointing/test_model_checkpoint.py::test_ckpt_version_counter_disabled_after_rerun_new_trainer": LIST,
    "checkpointing/test_model_checkpoint.py::test_check_val_every_n_epochs_top_k_integration": LIST,
    "checkpointing/test_model_checkpoint.py::test_resume_training_preserves_old_ckpt_last": LIST,
    "checkpointing/test_model_checkpoint.py::test_save_last_saves_correct_last_model_path": LISTLOCK,
    "checkpointing/test_model_checkpoint.py::test_save_last_versioning": LIST,
    "checkpointing/test_model_checkpoint.py::test_none_monitor_saves_correct_best_model_path": LISTLOCK,
    "checkpointing/test_model_checkpoint.py::test_resume_and_old_checkpoint_files_remain[True]": LIST,
    "checkpointing/test_model_checkpoint.py::test_resume_and_old_checkpoint_files_remain[False]": LIST,
    "checkpointing/test_trainer_checkpoint.py::test_finetuning_with_ckpt_path": LIST,
    "checkpointing/test_trainer_checkpoint.py::test_trainer_save_checkpoint_storage_options": STORAGE,
    "plugins/test_checkpoint_io_plugin.py::test_multi_wrapped_checkpoint_io_initialization": DEFAULT,
    "trainer/connectors/test_checkpoint_connector.py::test_hpc_restore_attempt": LISTLOCK,
    "trainer/connectors/test_checkpoint_connector.py::test_local_cross_device_checkpoint": URL,
    "trainer/connectors/test_checkpoint_connector.py::test_ckpt_for_fsspec": URL,
}

#: False under ``SHMCKPT_LIGHTNING_SWAP=0``.
SWAPPED = os.environ.get("SHMCKPT_LIGHTNING_SWAP", "1") != "0"

#: Lightning's test files these lists are for, relative to ``tests/tests_pytorch`` of the
#: checkout (tag 2.6.5). Not run: ``checkpointing/test_legacy_checkpoints.py`` (it loads
#: ``torch.save`` checkpoints of past Lightning versions downloaded from Lightning's
#: bucket; the plugin hands such files to ``TorchCheckpointIO`` unchanged).
FILES = (
    "plugins/test_checkpoint_io_plugin.py",
    "checkpointing/test_checkpoint_callback_frequency.py",
    "checkpointing/test_model_checkpoint.py",
    "checkpointing/test_torch_saving.py",
    "checkpointing/test_trainer_checkpoint.py",
    "trainer/connectors/test_checkpoint_connector.py",
)

#: Lightning's own warning filter for its tests (its conftest adds the same).
DEPRECATION_ERROR = "error::lightning.fabric.utilities.rank_zero.LightningDeprecationWarning"


def lightning_id(item: Any) -> Optional[str]:
    """``checkpointing/test_x.py::test_y[param]``: the id relative to the ``tests_pytorch``
    directory the item's file is in; None for any other test."""
    path = Path(str(item.path))
    for parent in path.parents:
        if parent.name == "tests_pytorch":
            return path.relative_to(parent).as_posix() + "::" + item.name
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "flaky: rerun on failure in Lightning's CI (not here)")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    for item in items:
        vid = lightning_id(item)
        if vid is None:
            continue
        item.add_marker(pytest.mark.filterwarnings(DEPRECATION_ERROR))
        reason = XFAIL.get(vid) if SWAPPED else None
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


@pytest.fixture(autouse=True)
def shmckpt_checkpoint_io(monkeypatch: pytest.MonkeyPatch, thread_police_duuu_daaa_duuu_daaa: None) -> Iterator[List[Any]]:
    # Requesting Lightning's thread check (its conftest's autouse fixture) makes it start
    # before this fixture and end after it: the plugins' worker threads are gone when it
    # looks.
    from shmckpt.lightning import ShmckptCheckpointIO

    made: List[Any] = []
    if not SWAPPED:
        yield made
        return

    def default_checkpoint_io() -> ShmckptCheckpointIO:
        io = ShmckptCheckpointIO()
        made.append(io)
        return io

    strategy_module = sys.modules["lightning.pytorch.strategies.strategy"]
    monkeypatch.setattr(strategy_module, "TorchCheckpointIO", default_checkpoint_io)
    yield made
    errors = []
    for io in made:
        try:
            io.teardown()
        except Exception as e:  # every plugin is torn down; the first error fails the test
            errors.append(e)
    if errors:
        raise errors[0]
