"""Public API of shmckpt (see docs/python.md)."""

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import errors as errors
from .errors import (
    ChecksumError as ChecksumError,
    ConfigError as ConfigError,
    CorruptError as CorruptError,
    CudaError as CudaError,
    DestinationError as DestinationError,
    DuplicateName as DuplicateName,
    EmptyName as EmptyName,
    HeaderTooLarge as HeaderTooLarge,
    InvalidInput as InvalidInput,
    InvalidMetadata as InvalidMetadata,
    InvalidName as InvalidName,
    IoError as IoError,
    IpcError as IpcError,
    NotFound as NotFound,
    RecoveryError as RecoveryError,
    ReplicationError as ReplicationError,
    RootLocked as RootLocked,
    RootMissing as RootMissing,
    RootCreateFailed as RootCreateFailed,
    RootNotWritable as RootNotWritable,
    ShapeOverflow as ShapeOverflow,
    ShmckptError as ShmckptError,
    ShmError as ShmError,
    ShmTooSmall as ShmTooSmall,
    ShutdownError as ShutdownError,
    SaveFailed as SaveFailed,
    Cancelled as Cancelled,
    SizeOverflow as SizeOverflow,
    UnsafePath as UnsafePath,
    StepOverflow as StepOverflow,
    RootTooLong as RootTooLong,
    SizeMismatch as SizeMismatch,
    StepExists as StepExists,
    TooLarge as TooLarge,
    Truncated as Truncated,
    UnsupportedValue as UnsupportedValue,
)

__version__: str
STATE_KEY: str

StepArg = Union[int, str, None]

class SaveHandle:
    step: int
    def staged(self) -> bool: ...
    def done(self) -> bool: ...
    def wait_staged(self) -> Optional[Dict[str, Any]]: ...
    def wait(self) -> Dict[str, Any]: ...
    def wait_remote(self) -> Dict[str, Any]: ...
    def wait_replicated(self) -> Dict[str, Any]: ...

class LoadResult:
    step: int
    missing_keys: List[str]
    unexpected_keys: List[str]

class Checkpointer:
    rank: int
    world_size: int
    root: str
    remote: Optional[str]
    def __init__(
        self,
        root: Union[str, os.PathLike],
        *,
        keep_last: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        staging_capacity: Optional[int] = None,
        chunk_size: Optional[int] = None,
        writer_threads: Optional[int] = None,
        queue_depth: Optional[int] = None,
        copy_threads: Optional[int] = None,
        direct_io: Optional[bool] = None,
        max_inflight_saves: Optional[int] = None,
        recover_on_open: Optional[bool] = None,
        keep_in_memory: bool = False,
        replicas: int = 0,
        node: Optional[str] = None,
        replica_group: Any = None,
        shm_name: Optional[str] = None,
        remote: Optional[str] = None,
        remote_keep_last: Optional[int] = None,
        remote_max_pending: Optional[int] = None,
    ) -> None: ...
    def save(
        self,
        step: int,
        state: Any,
        *,
        blocking: bool = True,
        metadata: Optional[Mapping[str, str]] = None,
    ) -> SaveHandle: ...
    def guard(self, optimizer: Any) -> None: ...
    def unguard(self, optimizer: Any) -> None: ...
    def wait_staged(self) -> None: ...
    def wait(self) -> None: ...
    def flush(self) -> None: ...
    def remove(self, step: int) -> None: ...
    def load(
        self, step: StepArg = "latest", *, map_location: Any = None, source: Optional[str] = None
    ) -> Any: ...
    def load_into(self, target: Any, step: StepArg = "latest", *, strict: bool = True) -> LoadResult: ...
    @property
    def last_load_source(self) -> Optional[Tuple[str, Any]]: ...
    def latest(self) -> Optional[int]: ...
    def list(self, remote: bool = False) -> List[int]: ...
    def manifest(self, step: StepArg = "latest") -> Dict[str, Any]: ...
    def prepare_cuda(
        self, devices: Optional[Sequence[int]] = None, *, background: bool = False
    ) -> Optional[float]: ...
    def staging_ready(self) -> bool: ...
    def wait_staging_ready(self) -> None: ...
    @property
    def shm_name(self) -> str: ...
    @property
    def staging_capacity(self) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Checkpointer": ...
    def __exit__(self, *exc: Any) -> None: ...

class Flat:
    tree: Any
    leaves: List[Any]

def flatten(state: Any) -> Flat: ...
def unflatten(tree: Any, lookup: Any) -> Any: ...
