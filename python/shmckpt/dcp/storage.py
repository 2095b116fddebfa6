"""The layout of a DCP checkpoint written by shmckpt: file names, metadata keys, and
``ShmckptStorageInfo`` (where one DCP item is)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from torch.distributed.checkpoint.filesystem import _StorageInfo


METADATA_FILE = ".metadata"
MANIFEST_FILE = "manifest.json"
#: Spool directory (next to the checkpoint directories) where the engines write.
SPOOL_NAME = ".shmckpt-dcp"
#: Transform descriptor of every item: DCP's FileSystemReader names it in its error.
DESCRIPTOR = "shmckpt-safetensors/1"
#: Keys of the safetensors ``__metadata__`` that DCP's HuggingFaceStorageReader reads.
_HF_SHARDING_KEY = "DCP_SHARDING_INFO"
_FORMAT_KEY = "shmckpt_dcp.format"
_FILE_RE = re.compile(r"rank-(\d{5,10})-of-(\d{5,10})\.safetensors")


@dataclass
class ShmckptStorageInfo(_StorageInfo):
    """Where one DCP item is: ``relative_path`` (a rank file in the checkpoint directory),
    ``offset``/``length`` (its bytes in that file), ``tensor`` (its name in the file) and
    ``crc32c`` (CRC-32C of its bytes, as in ``manifest.json``)."""

    tensor: str = ""
    crc32c: Optional[int] = None
