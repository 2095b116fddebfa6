"""shmckpt: checkpoint PyTorch training state without stalling the trainer.

The Rust engine stages tensors into POSIX shared memory and writes standard safetensors
files with io_uring; this package flattens nested state (model, optimizer, scheduler, RNG,
plain values) into named tensors plus a typed JSON skeleton and drives the engine.

    import shmckpt
    ckpt = shmckpt.Checkpointer("/ckpt", keep_last=3)   # remote="s3://b/run", replicas=1
    ckpt = shmckpt.Checkpointer("/ckpt", keep_last=3, tuning=shmckpt.Tuning(writer_threads=8))
    ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
    h = ckpt.save(step, state, blocking=False)   # h.wait_staged(), h.wait(), h.done()
    ckpt.guard(opt)                              # opt.step() waits for a save still staging
    state = ckpt.load("latest", map_location="cuda:0")
    ckpt.load_into({"model": model.state_dict(), "optim": opt.state_dict()})
    shmckpt.export("/ckpt", "/hf-model")         # Hugging Face shards + index

See docs/python.md in the repository.
"""

from . import errors
from ._export import ExportReport, export
from ._state import STATE_KEY, flatten, unflatten
from .checkpointer import Checkpointer, LoadResult, SaveHandle
from .config import Cadence, RemoteTier, Replicas, Tuning
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "SaveHandle",
    "LoadResult",
    "Tuning",
    "RemoteTier",
    "Replicas",
    "Cadence",
    "STATE_KEY",
    "flatten",
    "unflatten",
    "errors",
    "export",
    "ExportReport",
] + list(_errors_all)
