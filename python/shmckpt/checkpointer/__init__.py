"""``Checkpointer``: save and restore nested PyTorch training state through the engine.

One class (``core``: constructor, lifecycle, queries) whose methods delegate to plain
collaborators, one module each, built by its constructor with explicit arguments:
``save.Saver``, ``guard.Guard``, ``load.Loader``, ``load_into.InPlaceLoad``; ``base.Shared``
is the state they are all given, ``handle`` holds ``SaveHandle`` and ``LoadResult``."""

from .core import Checkpointer
from .handle import LoadResult, SaveHandle

__all__ = ["Checkpointer", "SaveHandle", "LoadResult"]
