"""``Checkpointer``: save and restore nested PyTorch training state through the engine.

The class is assembled from mixins, one module each: ``core`` (constructor, lifecycle,
queries), ``save``, ``guard``, ``load``, ``load_into``; ``handle`` holds ``SaveHandle`` and
``LoadResult``, ``base`` the state they share."""

from .core import Checkpointer
from .handle import LoadResult, SaveHandle

__all__ = ["Checkpointer", "SaveHandle", "LoadResult"]
