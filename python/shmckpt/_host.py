"""What the replication collaborator of a :class:`~shmckpt.Checkpointer` uses of it, as a
structural type: the replicator is given the state the checkpointer's collaborators share
(``checkpointer.base.Shared``: identity, engine, manifests) and never imports the
``checkpointer`` package (which builds it), so that no module of the package imports one
that imports it back."""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Tuple, Union


class CheckpointerLike(Protocol):
    """What :mod:`shmckpt.replicas` uses of a checkpointer (its ``Shared`` state)."""

    root: str
    rank: int
    world_size: int
    remote: Optional[str]
    engine: Any

    def manifest(self, step: Union[int, str, None] = "latest") -> Dict[str, Any]: ...

    def rank_entry(self, step: int) -> Tuple[Dict[str, Any], Dict[str, Any]]: ...

