"""Type stub of ``shmckpt.megatron`` (Megatron-Core dist_checkpointing through shmckpt)."""

import os
from pathlib import Path
from typing import Any, Dict, Optional, Union

from megatron.core.dist_checkpointing.mapping import ShardedStateDict, StateDict
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from torch.distributed.checkpoint.metadata import Metadata

BACKEND: str
VERSION: int

class ShmckptSaveShardedStrategy(TorchDistSaveShardedStrategy):
    spool: Optional[Union[str, os.PathLike]]
    writer_options: Dict[str, Any]
    last_writer: Optional[Any]
    def __init__(
        self,
        backend: str = ...,
        version: int = ...,
        keep_only_main_replica: bool = ...,
        *,
        spool: Optional[Union[str, os.PathLike]] = ...,
        staging_capacity: Optional[int] = ...,
        chunk_size: Optional[int] = ...,
        writer_threads: Optional[int] = ...,
        queue_depth: Optional[int] = ...,
        copy_threads: Optional[int] = ...,
        direct_io: Optional[bool] = ...,
        max_inflight_saves: Optional[int] = ...,
    ) -> None: ...
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> AsyncRequest:
        """Plan as Megatron's ``torch_dist`` strategy does, stage this rank's items into
        shared memory, and return the ``AsyncRequest`` (wait for durability, then commit
        in its finalize function)."""
        ...

class ShmckptLoadShardedStrategy(TorchDistLoadShardedStrategy):
    direct_io: bool
    def __init__(self, *, direct_io: bool = ...) -> None: ...
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> StateDict: ...
    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path], metadata: Optional[Metadata] = ...) -> Any: ...
    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict: ...
    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None: ...

def register() -> None:
    """Register the strategies as Megatron's defaults for backend ``shmckpt_dist``, version 1."""
    ...
