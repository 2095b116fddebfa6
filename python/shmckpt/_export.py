"""``shmckpt.export``: a checkpoint as Hugging Face safetensors shards plus their index.

A thin layer over the Rust engine (``shmckpt::export``, docs/export.md): the engine picks
the tensors, reads them with ranged reads (CRC-32C verified), re-joins DCP shards, casts on
request and publishes the output directory atomically. This module only turns a
``rename`` callable into the explicit name list the engine takes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, Union

from . import _shmckpt

__all__ = ["export", "ExportReport"]

_TORCH_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export` wrote."""

    #: The checkpoint directory read (the step directory of a root).
    source: str
    #: Its step.
    step: int
    #: The output directory.
    out: str
    #: The shard files in order, then ``model.safetensors.index.json`` (names in ``out``).
    files: List[str]
    #: Tensors exported.
    tensors: int
    #: Bytes of tensor data written.
    bytes: int
    #: Bytes read from the rank files.
    bytes_read: int
    #: Wall time of the export.
    seconds: float


def export(
    src: Union[str, "os.PathLike[str]"],
    out: Union[str, "os.PathLike[str]"],
    format: str = "hf",
    max_shard_size: Union[int, str] = "5GB",
    rename: Optional[Callable[[str], Optional[str]]] = None,
    dtype: Any = None,
    include_optimizer: bool = False,
    overwrite: bool = False,
) -> ExportReport:
    """Write the checkpoint ``src`` (a root: its latest step; a ``step-N`` directory; a DCP
    checkpoint written by :class:`shmckpt.dcp.ShmckptWriter`; ``s3://bucket/prefix`` (its
    latest committed step) or ``s3://bucket/prefix/step-N``; ``memory:ROOT``, the images
    flash restore keeps in ``/dev/shm`` for ROOT's latest committed step) to ``out`` as
    ``model-0000k-of-0000n.safetensors`` shards and ``model.safetensors.index.json``.

    * Default selection: with a ``model`` part in the state, its tensors without the
      ``model.`` prefix; else every tensor but the optimizer's (top-level ``optim``,
      ``optimizer``, ...). ``include_optimizer=True``: every tensor, full names.
    * ``rename(name)``: the exported name of each selected tensor, or ``None`` to leave it
      out.
    * ``max_shard_size``: bytes, or ``"5GB"``/``"500MB"`` (powers of 10), ``"5GiB"``.
    * ``dtype``: ``"bf16"``/``torch.bfloat16``, ``"fp16"``, ``"fp32"``: floating tensors are
      cast as torch casts (round to nearest even); others are kept.
    * ``out`` appears whole or not at all; an existing non-empty ``out`` is refused
      (:class:`~shmckpt.errors.UnsafePath`) unless ``overwrite``.
    """
    if format != "hf":
        raise ValueError(f"export: unknown format {format!r} (only 'hf')")
    src_s, out_s = os.fspath(src), os.fspath(out)
    names: Optional[List[Tuple[str, str]]] = None
    if rename is not None:
        names = []
        for name, _dt, _shape in _shmckpt.export_names(src_s, include_optimizer):
            new = rename(name)
            if new is None:
                continue
            if not isinstance(new, str):
                raise TypeError(f"export: rename({name!r}) returned {type(new).__name__}, expected str or None")
            names.append((name, new))
    dt: Optional[str]
    if dtype is None:
        dt = None
    elif isinstance(dtype, str):
        dt = dtype
    else:
        dt = _TORCH_DTYPES.get(str(dtype))
        if dt is None:
            raise ValueError(f"export: cannot cast to {dtype} (bf16, fp16, fp32)")
    size = str(max_shard_size) if isinstance(max_shard_size, int) else max_shard_size
    r = _shmckpt.export_hf(src_s, out_s, size, names, dt, include_optimizer, overwrite)
    return ExportReport(
        source=str(r["source"]),
        step=int(r["step"]),
        out=out_s,
        files=list(r["files"]),
        tensors=int(r["tensors"]),
        bytes=int(r["bytes"]),
        bytes_read=int(r["bytes_read"]),
        seconds=float(r["seconds"]),
    )
