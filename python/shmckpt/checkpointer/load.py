"""``Checkpointer.load``: a checkpoint back as the nested state it was saved as
(:class:`Loader`; the in-place load is ``load_into.py``'s)."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

import numpy as np

from .. import _state, _util
from .. import remote as _remote
from ..errors import CorruptError, DestinationError, NotFound
from .base import Shared, StepArg, _step_sel

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]

T = TypeVar("T")


class Loader:
    """The loads of one :class:`~shmckpt.Checkpointer`: its ``load`` and ``load_into``
    delegate here."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def skeleton(self, step: int, entry: Dict[str, Any]) -> Optional[Any]:
        d = os.path.join(self.shared.root, f"step-{step}")
        path = os.path.join(d, entry["file"])
        # Read by the engine after the header is checked against the manifest (its tensors
        # and its CRC-32C): a damaged header is an error, never a skeleton read wrongly.
        meta = self.shared.engine.file_metadata(step)
        text = meta.get(_state.STATE_KEY)
        if text is None:
            return None
        try:
            return _state.decode(text)
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise CorruptError(
                f"{path}: malformed {_state.STATE_KEY} metadata: {e}", path=path, step=step
            ) from None

    # -- load --------------------------------------------------------------------------
    def load(
        self, step: StepArg = "latest", *, map_location: Any = None, source: Optional[str] = None
    ) -> Any:
        """Load a checkpoint: the nested state as saved (tensors, arrays, plain values).

        ``map_location=None`` or ``"cpu"``: CPU tensors backed by the loaded buffers (no
        copy). ``"cuda:N"``: tensors on that device, copied from the staging memory while
        the file is read (from the bucket: each ranged GET's body through CUDA-registered
        staging buffers, no host copy of the file). Checkpoints not written by this package
        come back as a flat dict of tensors. Every CRC-32C is verified.

        ``source``: ``None`` serves the step from memory (``keep_in_memory``), else the
        local disk, else the bucket (``remote=...``; "latest" means the disk's latest when
        the disk holds any); ``"local"`` never reads the bucket; ``"remote"`` reads only
        the bucket. With ``None``, a step whose file on the disk is damaged (missing,
        short, malformed, a checksum error) is read from the bucket when the bucket's
        manifest lists this rank's file with the same size, tensors and checksums;
        otherwise the disk's error is raised. :attr:`last_load_source` says which served
        it.
        """
        sel = _step_sel(step)
        if self.shared.replicator is not None and source != "remote":
            # Collective: "latest" is the newest step every rank can load.
            sel = self.shared.replicator.agree_step(sel, bucket=source is None)
        s, where = _remote.resolve(self.shared, sel, source)
        dev = None
        if map_location is not None:
            dev = torch.device(map_location) if torch is not None else None
            if dev is not None and dev.type == "cpu":
                dev = None
            elif dev is not None and dev.type != "cuda":
                raise ValueError(f"map_location {map_location!r}: only cpu and cuda are supported")
        objs: Dict[str, Any] = {}
        if where == "remote" and dev is not None:
            # Bucket -> registered staging buffers -> device (no host copy of the file).
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            objs, tree, entry = _remote.load_to_device(self.shared, s, dev)
        elif where == "remote":
            # Read into host buffers (checked); the skeleton is the rank file's header's.
            _, _, file_meta, tensors = self.shared.engine.load_remote(s)
            tree = _remote.skeleton(self.shared, s, file_meta)
            entry = _remote.entry_of(tensors)
            for name, dtype, shape, buf in tensors:
                objs[name] = (dtype, shape, buf)
        else:
            objs, tree, entry = self.with_peer_retry(s, False, lambda: self.read_local(s, dev, source))

        file_dtype = {t["name"]: t["dtype"] for t in entry["tensors"]}

        def host_tensor(name: str, node: Optional[Dict[str, Any]]) -> Any:
            o = objs[name]
            if node is not None and node.get("t") == "ndarray":
                ndt = np.dtype(str(node.get("dtype")))
                if _state.NUMPY_TO_ST.get(ndt) != file_dtype.get(name):
                    raise ValueError(f"array {name!r}: numpy dtype {ndt} does not match the file")
                if not isinstance(o, tuple):  # loaded to a device: arrays live on the host
                    shape = list(o.shape)
                    a = o.cpu().contiguous().view(-1).view(torch.uint8).numpy()
                else:
                    _, shape, buf = o
                    a = np.asarray(buf)
                return a.view(ndt).reshape(shape) if a.size else np.empty(shape, dtype=ndt)
            if not isinstance(o, tuple):
                return o
            dtype, shape, buf = o
            tdt = _torch_dtype_for(node, dtype)
            n = len(buf)
            if n == 0:
                return torch.empty(shape, dtype=tdt)
            u8 = torch.from_numpy(np.asarray(buf))
            return u8.view(tdt).reshape(shape)

        if tree is None:
            return {name: host_tensor(name, None) for name in objs}

        made: Dict[str, Any] = {}

        def lookup(node: Dict[str, Any]) -> Any:
            name = node.get("alias") or node["n"]
            if name not in made:
                if name not in objs:
                    raise ValueError(f"tensor {name!r} is not in the file")
                made[name] = _finish_tensor(host_tensor(name, node), node)
            return made[name]

        try:
            return _state.unflatten(tree, lookup)
        except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
            raise CorruptError(
                f"step {s} of {self.shared.root}, rank {self.shared.rank}: the {_state.STATE_KEY} metadata "
                f"does not describe the file: {e}"
            ) from None

    def with_peer_retry(self, s: int, into: bool, read: Callable[[], T]) -> T:
        """``read()`` of ``s`` from this rank's memory or disk. With replicas it is
        collective before and after: a rank whose file is lost (missing, of the wrong
        size) gets it from a partner's replica before reading; after every rank read
        (whatever its read or that fetch raised, so that no rank waits for one that left),
        a rank whose file turned out damaged inside gets it the same way, written back over
        the file, and reads again (``into``: ``load_into``, which reads the written-back
        file rather than the received image)."""
        rep = self.shared.replicator
        if rep is None:
            return read()
        try:
            rep.before_load(s)  # collective: a lost file comes from a peer
            if into:
                rep.discard_image()  # filled from the written-back file
            got = read()
            err: Optional[Exception] = None
        except Exception as e:  # every rank joins the collective below, then re-raises
            err = e
        if rep.after_load(s, err):
            if into:
                rep.discard_image()
            return read()
        if err is not None:
            raise err
        return got

    def read_local(self, s: int, dev: Any, source: Optional[str]) -> Tuple[Dict[str, Any], Optional[Any], Dict[str, Any]]:
        """This rank's tensors of ``s`` from memory, the disk (a damaged file: the bucket's
        copy unless ``source="local"``) or the image a partner just sent; to CUDA device
        ``dev`` when given. Returns ``(tensors by name, the skeleton or None, this rank's
        file entry)``; host tensors as ``(dtype, shape, buffer)``."""
        objs: Dict[str, Any] = {}
        _, entry = self.shared.rank_entry(s)
        tree = self.skeleton(s, entry)
        image = None
        if dev is None and self.shared.replicator is not None:
            # A lost rank's image a partner just sent (checked, and written back as its
            # file): the tensors are served from that memory, not read back from disk.
            image = self.shared.replicator.take_image(s)
        if image is not None:
            whole = np.asarray(image)
            for name, dtype, shape, a, b in image.tensors():
                objs[name] = (dtype, shape, whole[a:b])
        elif dev is None:
            # (A file damaged on the disk is read from the bucket when it holds the same
            # bytes, unless source="local".)
            _, _, _, tensors = self.shared.engine.load(s, bucket=source != "local")
            for name, dtype, shape, buf in tensors:
                objs[name] = (dtype, shape, buf)
        else:
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            dest = []
            for t in entry["tensors"]:
                tdt = _state.ST_TO_TORCH.get(t["dtype"])
                if tdt is None:
                    raise DestinationError(f"tensor {t['name']!r}: dtype {t['dtype']} has no torch dtype")
                x = torch.empty(t["shape"], dtype=tdt, device=dev)
                objs[t["name"]] = x
                dest.append(x)
            # The memory may come from blocks freed by work still queued on this stream.
            torch.cuda.current_stream(dev).synchronize()
            self.shared.engine.load_into_device(
                s,
                [(n, _util.dest_capsule(x), dev.index) for n, x in objs.items()],
                bucket=source != "local",
            )
        return objs, tree, entry


def _torch_dtype_for(node: Optional[Dict[str, Any]], st_dtype: str) -> Any:
    if node is not None and node.get("dtype"):
        dt = getattr(torch, node["dtype"], None)
        if dt is not None and _state.TORCH_TO_ST.get(dt) == st_dtype:
            return dt
    dt = _state.ST_TO_TORCH.get(st_dtype)
    if dt is None:
        raise DestinationError(f"dtype {st_dtype} has no torch equivalent")
    return dt


def _finish_tensor(x: Any, node: Dict[str, Any]) -> Any:
    """The loaded tensor ``x`` as its skeleton node says (an ``nn.Parameter``). Raises
    ``ValueError`` for a node that cannot describe ``x`` (``load`` makes it a
    ``CorruptError``)."""
    if node.get("param") and torch is not None:
        rg = bool(node.get("requires_grad", True))
        if rg and not (x.is_floating_point() or x.is_complex()):
            raise ValueError(
                f"tensor {node.get('n')!r:.80}: a {x.dtype} parameter cannot require gradients"
            )
        return torch.nn.Parameter(x, requires_grad=rg)
    return x
