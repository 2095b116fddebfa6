"""Type stub of ``shmckpt.dcp`` (PyTorch Distributed Checkpoint storage through shmckpt)."""

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

METADATA_FILE: str
MANIFEST_FILE: str
SPOOL_NAME: str
DESCRIPTOR: str
MAX_METADATA_BYTES: int

@dataclass
class ShmckptStorageInfo(_StorageInfo):
    tensor: str = ...
    crc32c: Optional[int] = ...

def release() -> None:
    """Finish the saves in flight and free every engine ``ShmckptWriter`` opened in this
    process, and the registered read buffers of ``ShmckptReader``'s device loads."""
    ...

def prepare(
    parent: Union[str, os.PathLike],
    *,
    staging_capacity: int,
    devices: Optional[Sequence[int]] = None,
    spool: Optional[Union[str, os.PathLike]] = None,
    process_group: Any = None,
    chunk_size: Optional[int] = None,
    writer_threads: Optional[int] = None,
    queue_depth: Optional[int] = None,
    copy_threads: Optional[int] = None,
    direct_io: Optional[bool] = None,
    max_inflight_saves: Optional[int] = None,
) -> Dict[str, Any]:
    """Open this rank's engine for checkpoints published under ``parent`` at start-up
    (arena created, pre-faulted and registered with CUDA for ``devices``), so that the
    first save does not pay for it. Returns ``{"open_s", "cuda_registration_s",
    "staging_capacity", "shm_name"}``."""
    ...

class ShmckptWriter(StorageWriter, AsyncStager):
    path: str
    save_id: str
    is_coordinator: bool
    last_report: Optional[Dict[str, Any]]
    #: Where the last stage() spent its time: items_s, submit_s, total_s, engine.
    last_stage: Dict[str, Any]
    def __init__(
        self,
        path: Union[str, os.PathLike],
        *,
        spool: Optional[Union[str, os.PathLike]] = None,
        process_group: Any = None,
        staging_capacity: Optional[int] = None,
        chunk_size: Optional[int] = None,
        writer_threads: Optional[int] = None,
        queue_depth: Optional[int] = None,
        copy_threads: Optional[int] = None,
        direct_io: Optional[bool] = None,
        max_inflight_saves: Optional[int] = None,
    ) -> None: ...
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None: ...
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None: ...
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan: ...
    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]: ...
    def storage_meta(self) -> Optional[StorageMeta]: ...
    @property
    def checkpoint_id(self) -> str: ...
    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool: ...
    def stage(self, state_dict: Dict[str, Any], **kwargs: Any) -> Dict[str, Any]: ...
    def synchronize_staging(self) -> None: ...
    def close(self) -> None: ...
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[List[WriteResult]]: ...
    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None: ...

class ShmckptReader(StorageReader):
    path: str
    direct_io: bool
    load_id: str
    #: What the last read_data did: {"files", "device_items", "direct_host_items", "host_items"}.
    last_read: Optional[Dict[str, int]]
    def __init__(self, path: Union[str, os.PathLike], *, direct_io: bool = True) -> None: ...
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None: ...
    def read_metadata(self) -> Metadata: ...
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None: ...
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan: ...
    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]: ...
    @property
    def checkpoint_id(self) -> str: ...
    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool: ...
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]: ...
