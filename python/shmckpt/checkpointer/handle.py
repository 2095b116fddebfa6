"""``SaveHandle`` and ``LoadResult``, under the checkpointer's name: they live in
:mod:`shmckpt._handle`, below the checkpointer and the tiers (``replicas``,
``_divergence``) that name them, so that no tier imports the checkpointer."""

from .._handle import LoadResult, SaveHandle

__all__ = ["LoadResult", "SaveHandle"]
