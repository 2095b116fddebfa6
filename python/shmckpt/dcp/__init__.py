"""PyTorch Distributed Checkpoint (DCP) storage through shmckpt.

    import torch.distributed.checkpoint as dcp
    from shmckpt.dcp import ShmckptWriter, ShmckptReader

    resp = dcp.async_save(state_dict, storage_writer=ShmckptWriter("/ckpt/step-100"))
    ...
    dcp.load(state_dict, storage_reader=ShmckptReader("/ckpt/step-100"))

DCP keeps doing what it does (planning, de-duplication of replicated tensors, DTensor /
FSDP2 / ShardedTensor shards, ``Stateful`` objects, resharding on load); shmckpt replaces
the staging and the storage:

* ``ShmckptWriter`` is a ``StorageWriter`` and DCP's ``AsyncStager``, so ``async_save``
  uses it as its stager. ``stage()`` hands every tensor (the local shard of a DTensor) to
  the engine of this rank, which copies it into its shared-memory arena (device tensors
  with ``cuMemcpyDtoHAsync`` on the engine's own stream, ordered after the caller's
  current stream; no device memory is allocated) and returns once everything is staged.
  The engine's io_uring writers write the file while DCP plans in its upload thread;
  ``write_data`` waits for it to be durable. Non-tensor values are serialized at the call
  (``torch.save``, as DCP's planner does) and stored as ``U8`` tensors.
* Layout: a checkpoint directory ``P`` is a committed shmckpt step directory plus DCP's
  ``.metadata``::

      P/rank-00000-of-00004.safetensors   one safetensors file per rank (CRC-32C in the manifest)
      P/manifest.json                     shmckpt's manifest (per tensor: offsets, CRC-32C)
      P/.metadata                         DCP's metadata; storage_data = ShmckptStorageInfo
                                          (file, offset, length, tensor name, CRC-32C)

* Commit: each rank's engine writes its file and manifest part into its own root in the
  spool ``dirname(P)/.shmckpt-dcp`` and commits nothing (a part-only save, in
  ``step-N.partial``; ``N`` is a private number the ranks agree on). DCP's coordinator (``finish``) then commits through the engine's
  commit protocol in Rust: ``assemble_ranks`` moves every rank's durable file into
  ``spool/step-N`` and writes ``manifest.json``; ``publish_dir`` writes ``.metadata``
  (temporary name, ``fsync``, ``rename``, directory ``fsync``) and publishes the whole
  directory as ``P`` with one ``rename`` (and ``fsync`` of both parents). Before that
  rename nothing exists at ``P``; after it, ``P`` is complete and durable. ``P`` must not
  exist, or be an empty directory.
* One engine (one arena) per rank and spool directory is kept for the life of the process
  and reused by every save, so host memory stays flat across saves; it is reopened only
  when a save needs more staging than it has. ``prepare(parent, staging_capacity=...)``
  opens it (and registers it with CUDA) at start-up, so that the first save does not pay
  for it; ``release()`` frees it.

``ShmckptReader`` reads ``.metadata`` (with a restricted unpickler: only DCP's metadata
classes), then the tensors the load plan needs of each rank file, and only those, through
the engine's ranged reader (O_DIRECT where possible, header checked against the manifest,
the CRC-32C of every tensor read verified) and copies
the requested regions into the planner's destination tensors, so DCP's resharding
(loading on another world size) works as with its own files.

Interchange: every rank file is a plain safetensors file whose tensors carry their DCP
names and whose ``__metadata__`` has DCP's ``DCP_SHARDING_INFO``, so DCP's own
``HuggingFaceStorageReader`` reads the tensors of a shmckpt checkpoint (``dcp.load`` with
``storage_reader=HuggingFaceStorageReader(P)``). DCP's ``FileSystemReader`` cannot: it
expects every item to be a ``torch.save`` stream, and fails on these files with
``ValueError: Unknown extension name='shmckpt-safetensors'`` (from the transform
descriptor every ``ShmckptStorageInfo`` carries) instead of reading wrong bytes.

The modules: ``storage`` (layout constants, ``ShmckptStorageInfo``), ``engines`` (the
engines of this process, ``prepare``/``release``, the spool's layout), ``items`` (the
items of one save and their owners), ``staging`` (``ShmckptWriter.stage``), ``writer``,
``reader``, ``metadata`` (the restricted unpickler of ``.metadata``).
"""

from .engines import prepare, release
from .metadata import MAX_METADATA_BYTES  # noqa: F401
from .reader import ShmckptReader
from .storage import DESCRIPTOR, MANIFEST_FILE, METADATA_FILE, SPOOL_NAME, ShmckptStorageInfo  # noqa: F401
from .writer import ShmckptWriter

__all__ = ["ShmckptWriter", "ShmckptReader", "ShmckptStorageInfo", "prepare", "release"]
