"""What the replication collaborator of a :class:`~shmckpt.Checkpointer` uses of it, as a
structural type: the replicator is given its checkpointer and never imports the
``checkpointer`` package (which builds it), so that no module of the package imports one
that imports it back."""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Tuple, Union


class CheckpointerLike(Protocol):
    """The part of :class:`~shmckpt.Checkpointer` that :mod:`shmckpt.replicas` uses."""

    root: str
    rank: int
    world_size: int
    remote: Optional[str]
    _engine: Any

    def manifest(self, step: Union[int, str, None] = "latest") -> Dict[str, Any]: ...

    def _rank_entry(self, step: int) -> Tuple[Dict[str, Any], Dict[str, Any]]: ...

