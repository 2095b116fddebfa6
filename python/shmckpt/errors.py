"""Exceptions of shmckpt: one class per error of the Rust engine, under ``ShmckptError``.

Every exception raised by the engine carries the Rust message (which names the file, tensor,
offset or errno concerned), ``kind`` (the class name), ``errno_code`` (the OS error
number when the error came from the OS, else ``None``) and the Rust error's fields:
``path`` (the file or directory concerned, a ``str``), ``tensor`` (the tensor's name),
``step`` (the checkpoint step) and ``offset`` (the byte offset of a failed read or write),
each ``None`` when the error has no such field. A failed save's ``path``, ``tensor`` and
``offset`` are those of its cause. They survive pickling (DCP sends a rank's exception to
the others pickled).

Input errors (``InvalidInput`` and its subclasses) are raised before anything is staged or
written. A value of the state given to ``save`` (or a destination of ``load_into``) that
cannot be stored faithfully (an unsupported type, dtype, tensor kind or nesting depth) is
``UnsupportedValue``, a ``TypeError`` naming the key path (``e.key``); two key paths that
give one name are a ``ValueError``. Both are raised before a byte is written.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

__all__ = [
    "ShmckptError",
    "InvalidInput",
    "EmptyName",
    "DuplicateName",
    "InvalidName",
    "SizeMismatch",
    "ShapeOverflow",
    "InvalidMetadata",
    "HeaderTooLarge",
    "TooLarge",
    "StepExists",
    "NotFound",
    "RootMissing",
    "RootNotWritable",
    "RootCreateFailed",
    "RootLocked",
    "ConfigError",
    "ShmTooSmall",
    "ShmError",
    "IoError",
    "CorruptError",
    "Truncated",
    "ChecksumError",
    "DestinationError",
    "CudaError",
    "ShutdownError",
    "RecoveryError",
    "SaveFailed",
    "Cancelled",
    "SizeOverflow",
    "UnsafePath",
    "StepOverflow",
    "RootTooLong",
    "UnsupportedValue",
    "RemoteError",
    "RemoteFailed",
    "RemoteSkipped",
    "RemoteConflict",
    "ReplicationError",
    "CommitRefused",
    "ReplicaDivergence",
]


class ShmckptError(Exception):
    """Base class of every error the shmckpt engine reports. The keyword arguments set the
    fields of the same names (the engine sets them on the errors it raises)."""

    kind: str = "ShmckptError"
    errno_code: Optional[int] = None
    #: The file or directory the error is about, or ``None``.
    path: Optional[str] = None
    #: The tensor the error is about, or ``None``.
    tensor: Optional[str] = None
    #: The checkpoint step the error is about, or ``None``.
    step: Optional[int] = None
    #: The byte offset in ``path`` of a failed read or write, or ``None``.
    offset: Optional[int] = None

    def __init__(
        self,
        *args: Any,
        path: Optional[str] = None,
        tensor: Optional[str] = None,
        step: Optional[int] = None,
        offset: Optional[int] = None,
    ):
        super().__init__(*args)
        # Instance attributes only when given: pickling (``BaseException.__reduce__``
        # keeps ``args`` and ``__dict__``) restores exactly what was set.
        for name, value in (("path", path), ("tensor", tensor), ("step", step), ("offset", offset)):
            if value is not None:
                setattr(self, name, value)


class InvalidInput(ShmckptError, ValueError):
    """The tensors or metadata given to ``save`` are invalid; nothing was written."""


class EmptyName(InvalidInput):
    """A tensor has an empty name (Rust ``Error::EmptyName``)."""


class DuplicateName(InvalidInput):
    """Two tensors share a name (Rust ``Error::DuplicateName``)."""


class InvalidName(InvalidInput):
    """A tensor name is too long or reserved (Rust ``Error::InvalidName``)."""


class SizeMismatch(InvalidInput):
    """A tensor's byte length does not match its dtype and shape (``Error::SizeMismatch``)."""


class ShapeOverflow(InvalidInput):
    """A shape's element count overflows 64 bits (``Error::ShapeOverflow``)."""


class InvalidMetadata(InvalidInput):
    """A metadata key is reserved (``shmckpt.`` prefix) or invalid."""


class HeaderTooLarge(InvalidInput):
    """The safetensors header would exceed the format's 100 MB limit."""


class TooLarge(ShmckptError, ValueError):
    """The checkpoint file is larger than the staging arena: raise ``staging_capacity``."""


class StepExists(ShmckptError, FileExistsError):
    """A checkpoint of this step already exists (committed or in flight)."""


class NotFound(ShmckptError, LookupError):
    """No committed checkpoint matches the request."""


class RootMissing(ShmckptError, FileNotFoundError):
    """The checkpoint root does not exist or is not a directory."""


class RootNotWritable(ShmckptError, PermissionError):
    """The checkpoint root cannot be written."""


class RootCreateFailed(RootMissing):
    """The checkpoint root does not exist and could not be created (the OS error is in the
    message and ``errno_code``)."""


class RootLocked(ShmckptError):
    """Another engine of the same rank holds this checkpoint root."""


class ConfigError(ShmckptError, ValueError):
    """An invalid engine setting."""


class ShmTooSmall(ShmckptError, MemoryError):
    """``/dev/shm`` cannot hold the staging arena."""


class ShmError(ShmckptError, OSError):
    """Creating, sizing or mapping the shared-memory arena failed."""


class IoError(ShmckptError, OSError):
    """An I/O call failed on a file (the message names the call, path, offset, errno)."""


class CorruptError(ShmckptError):
    """A checkpoint file or manifest is malformed."""


class Truncated(CorruptError):
    """A checkpoint file is shorter than its header or manifest promise."""


class ChecksumError(CorruptError):
    """A tensor's bytes do not match the CRC-32C in the manifest."""


class DestinationError(ShmckptError, ValueError):
    """A destination given to ``load_into`` does not fit the checkpoint."""


class CudaError(ShmckptError, RuntimeError):
    """The CUDA driver reported an error or is unavailable."""


class ShutdownError(ShmckptError, RuntimeError):
    """The engine was closed or a background thread died."""


class SaveFailed(ShmckptError, RuntimeError):
    """A save failed after it was accepted; the message names the step and the root cause
    (a write error, a CUDA error, ...). Nothing of that step was committed."""


class Cancelled(ShmckptError, RuntimeError):
    """A save was abandoned because the engine shut down before it finished."""


class SizeOverflow(InvalidInput):
    """A size computed from the input overflows 64 bits (Rust ``Error::SizeOverflow``)."""


class UnsafePath(ShmckptError, OSError):
    """A path under the root or in ``/dev/shm`` is a symbolic link, not a regular file or
    directory, or otherwise unsafe to use: it was refused, never followed."""


class StepOverflow(ShmckptError, ValueError):
    """The next step number would not fit in 64 bits."""


class RootTooLong(ConfigError):
    """The checkpoint root's path is too long to be recorded for crash recovery."""


class UnsupportedValue(ShmckptError, TypeError):
    """A value of the state given to ``save`` (or ``ShmckptWriter``), or a destination of
    ``load_into``, cannot be stored or filled faithfully: an unsupported type or dtype, a
    sparse, nested, meta, fake, functional or freed tensor, a tensor subclass with its own
    ``__torch_dispatch__``, a masked array, or a state nested too deeply. ``key`` names the
    value (its key path, e.g. ``state['optim']['f']``, or a DCP item's name). Raised before a
    byte is written."""

    def __init__(self, message: str, key: Optional[str] = None):
        super().__init__(message)
        self.key = key

    def __reduce__(self) -> Any:
        # (DCP sends a rank's exception to the others pickled: keep ``key`` and the fields.)
        return (type(self), (str(self), self.key), dict(self.__dict__))


class RecoveryError(ShmckptError):
    """A staging arena in ``/dev/shm`` cannot be recovered."""


class RemoteError(ShmckptError, OSError):
    """An object-store request failed (a missing bucket, refused credentials, an
    unreachable endpoint, a server error that outlasted the retries); the message names the
    bucket URL, the request and the server's answer."""


class RemoteFailed(RemoteError):
    """A save's copy to the bucket failed (``SaveHandle.wait_remote``): nothing of that
    step is visible in the bucket; the local checkpoint is unaffected."""


class RemoteSkipped(RemoteError):
    """A save's copy to the bucket was skipped because the uploader was behind
    (``remote_max_pending`` newer saves were waiting); newer steps go to the bucket."""


class RemoteConflict(RemoteFailed):
    """Another writer's upload of the same step to the same bucket prefix (a restarted job
    whose previous instance was still uploading) is the one committed there; this upload's
    object is not part of that step, and was not written over it. ``step`` names the step;
    the message, the bucket URL and the object the committed manifest names."""


class ReplicationError(ShmckptError, RuntimeError):
    """A step is not held by as many peer replicas as asked (``replicas=``), or the ranks
    disagree on the step to load (``shmckpt.replicas``)."""


class CommitRefused(ShmckptError, RuntimeError):
    """The commit of a save was refused before it became visible (Rust
    ``Error::CommitRefused``): nothing of the step was committed and this rank's file was
    removed. With ``check_replicas``: raised by ranks whose own replicas agree when
    another rank's save failed; the ranks holding a diverging replica raise
    :class:`ReplicaDivergence`."""


class ReplicaDivergence(ShmckptError, RuntimeError):
    """Data-parallel replicas of a tensor differ (``Checkpointer(check_replicas=group)``):
    some rank's copy is silently corrupted. ``step``; ``tensor`` and ``ranks`` (the
    checkpointer ranks whose copy differs from the majority's, or every rank of the group
    when no copy has a strict majority) name the first diverging tensor in name order;
    ``crcs`` maps each rank of the group to its CRC-32C of it; ``divergences`` lists every
    diverging tensor as ``(tensor, ranks, crcs)``; ``committed`` says whether the step was
    committed anyway (``on_divergence="warn"`` or a callback returning True)."""

    def __init__(
        self,
        message: str,
        step: int,
        divergences: List[Tuple[str, List[int], Dict[int, int]]],
        committed: bool = False,
    ):
        tensor, ranks, crcs = divergences[0]
        super().__init__(message, tensor=tensor, step=step)
        self.ranks = list(ranks)
        self.crcs = dict(crcs)
        self.divergences = [(t, list(r), dict(c)) for t, r, c in divergences]
        self.committed = committed

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.step, self.divergences, self.committed))


def _init_kind() -> None:
    for name in __all__:
        globals()[name].kind = name


_init_kind()
