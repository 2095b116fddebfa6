"""``Checkpointer.load_into``: a checkpoint read in place into the caller's tensors
(:class:`InPlaceLoad`, which the checkpointer's :class:`~.load.Loader` runs)."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .. import _state, _util
from .. import remote as _remote
from ..errors import CorruptError, DestinationError
from .base import StepArg, _step_sel
from .handle import LoadResult
from .load import Loader

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]


def _canonical(name: str) -> str:
    """A flat name without the ``_orig_mod.`` components ``torch.compile`` adds."""
    parts = [p for p in name.split(".") if p != "_orig_mod"]
    return ".".join(parts)


class InPlaceLoad:
    """The in-place load of one :class:`~shmckpt.Checkpointer` (``load_into``), over its
    :class:`~.load.Loader` (the peer retry, the skeleton) and their shared state."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self.shared = loader.shared

    def run(
        self,
        target: Any,
        step: StepArg = "latest",
        *,
        strict: bool = True,
    ) -> LoadResult:
        """Load a checkpoint in place into the tensors of ``target`` (e.g.
        ``{"model": model.state_dict(), "optim": opt.state_dict()}``), matched by flat
        name (``_orig_mod.`` components ignored on both sides).

        Names, dtypes, shapes and writability are checked before anything is read or
        written; a problem raises ``DestinationError`` listing every one. When ``target``
        is a dict, the checkpoint's top-level sub-trees (dicts, lists, tuples) whose key
        ``target`` does not have are left out: ``load_into({"model": sd})`` on a checkpoint
        that also holds ``optim``, ``sched`` and ``rng`` compares the ``model.*`` names
        exactly and ignores the rest (top-level tensors are always compared). With
        ``strict=False`` missing and unexpected keys are reported in the result instead. Plain values of ``target`` are
        not changed. Contiguous CPU destinations are read into directly; CUDA destinations
        through the staging memory with no host copy of your own. A step the local disk
        does not hold is read from the bucket (``remote=...``): into CUDA destinations
        through CUDA-registered staging buffers (no host copy of the file), else into host
        memory, checked, then copied into the destinations. With ``replicas > 0`` it is
        collective, as :meth:`load` is: a rank whose file is lost gets it from a partner's
        replica first.
        """
        sel = _step_sel(step)
        if self.shared.replicator is not None:
            # Collective: "latest" is the newest step every rank can load.
            sel = self.shared.replicator.agree_step(sel)
        s, where = _remote.resolve(self.shared, sel, None)
        if where == "remote":
            return self._load_into_step(target, s, where, strict)
        # With replicas, collective: a lost file, or one damaged inside, comes from a peer.
        return self.loader.with_peer_retry(s, True, lambda: self._load_into_step(target, s, where, strict))

    def _load_into_step(self, target: Any, s: int, where: str, strict: bool) -> LoadResult:
        """:meth:`load_into` of the resolved step ``s`` from ``where`` (``"local"`` or
        ``"remote"``)."""
        if where == "remote":
            # The manifest's entry and the header's skeleton; the data after the planning.
            entry = _remote.rank_entry(self.shared, s)
            tree = _remote.skeleton(self.shared, s, self.shared.engine.remote_file_metadata(s))
        else:
            _, entry = self.shared.rank_entry(s)
            tree = self.loader.skeleton(s, entry)
        aliases: Dict[str, str] = {}
        if tree is not None:
            for node in _state.tensor_nodes(tree):
                if node.get("alias"):
                    aliases[node["n"]] = node["alias"]
        flat = _state.flatten(target)
        stored = {t["name"]: t for t in entry["tensors"]}
        # Checkpoint names (stored and aliases) by canonical name.
        ck_names = list(stored) + list(aliases)
        canon: Dict[str, List[str]] = {}
        for n in ck_names:
            canon.setdefault(_canonical(n), []).append(n)

        def match(dname: str) -> Optional[str]:
            if dname in stored or dname in aliases:
                return dname
            c = canon.get(_canonical(dname))
            if c and len(c) == 1:
                return c[0]
            return None

        problems: List[str] = []
        missing: List[str] = []
        plan: Dict[str, List[Tuple[Leaf, Any]]] = {}  # stored name -> destinations
        used: set = set()
        for lf in flat.leaves:
            ck = match(lf.name)
            if ck is None:
                missing.append(lf.name)
                continue
            used.add(ck)
            src = aliases.get(ck, ck)
            t = stored.get(src)
            if t is None:
                problems.append(f"{lf.name}: alias of {src!r}, which is not in the file")
                continue
            want = _dest_dtype_name(lf)
            if want != t["dtype"] or list(lf.obj.shape) != list(t["shape"]):
                problems.append(
                    f"{lf.name}: checkpoint has {t['dtype']} {list(t['shape'])}, destination "
                    f"is {want} {list(lf.obj.shape)}"
                )
                continue
            bad = _unwritable(lf.obj)
            if bad is not None:
                problems.append(f"{lf.name}: the destination {bad}")
                continue
            plan.setdefault(src, []).append((lf, lf.obj))
        # Sub-trees of the checkpoint the target does not name are not compared.
        try:
            ignored = _unnamed_subtrees(tree, target)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CorruptError(
                f"step {s} of {self.shared.root}, rank {self.shared.rank}: malformed {_state.STATE_KEY} "
                f"metadata: {e}"
            ) from None
        unexpected = sorted({n for n in ck_names if n not in used and n not in ignored})
        if strict:
            problems += [f"{n}: in the destination, not in the checkpoint" for n in missing]
            problems += [f"{n}: in the checkpoint, not in the destination" for n in unexpected]
        if problems:
            raise DestinationError(
                f"cannot load step {s} of {self.shared.root} into the given state "
                f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems)
            )
        on_cuda = any(
            torch is not None and isinstance(d, torch.Tensor) and d.device.type == "cuda"
            for dests in plan.values()
            for _, d in dests
        )
        if where == "remote" and not on_cuda:
            _, _, _, remote_tensors = self.shared.engine.load_remote(s)
            _remote.copy_into(remote_tensors, plan)
        else:
            # (CUDA destinations from the bucket: through the registered staging buffers.)
            self._read_into(s, entry, plan, remote=where == "remote")
        return LoadResult(s, missing, unexpected)

    def _read_into(
        self, s: int, entry: Dict[str, Any], plan: Dict[str, List[Tuple[Any, Any]]], remote: bool = False
    ) -> None:
        cuda_dev = None
        for dests in plan.values():
            for _, d in dests:
                if torch is not None and isinstance(d, torch.Tensor) and d.device.type == "cuda":
                    cuda_dev = d.device
                    break
            if cuda_dev is not None:
                break
        direct: Dict[str, Any] = {}  # stored name -> destination read into directly
        copies: List[Tuple[Any, Any]] = []  # (destination, source) after the read
        scratch: Dict[str, Any] = {}
        ranges: List[Tuple[int, int]] = []

        def free_range(p: int, n: int) -> bool:
            for a, b in ranges:
                if p < b and a < p + n:
                    return False
            ranges.append((p, p + n))
            return True

        for t in entry["tensors"]:
            name = t["name"]
            dests = plan.get(name, [])
            chosen = None
            for _, d in dests:
                # Read into directly only where the memory holds the values as stored:
                # a little-endian array, a tensor with no conjugate or negative bit. The
                # others get a scratch buffer and a copy (which converts).
                if isinstance(d, np.ndarray):
                    ok = (
                        cuda_dev is None
                        and d.flags.c_contiguous
                        and d.flags.writeable
                        and _state.little_endian(d.dtype) is d.dtype
                    )
                    p, n = (int(d.ctypes.data), int(d.nbytes))
                else:
                    dd = d.detach()
                    on = dd.device.type
                    ok = (
                        dd.is_contiguous()
                        and not _state.is_lazy(dd)
                        and ((cuda_dev is None and on == "cpu") or (cuda_dev is not None and dd.device == cuda_dev))
                    )
                    p, n = (int(dd.data_ptr()), dd.numel() * dd.element_size())
                if ok and (n == 0 or free_range(p, n)):
                    chosen = d
                    break
            if chosen is None:
                buf: Any
                tdt = _state.ST_TO_TORCH.get(t["dtype"])
                if cuda_dev is None:
                    if tdt is not None:
                        buf = torch.empty(t["shape"], dtype=tdt)
                    else:
                        buf = np.empty(t["shape"], dtype=_state.ST_TO_NUMPY[t["dtype"]])
                else:
                    buf = torch.empty(t["shape"], dtype=tdt, device=cuda_dev)
                scratch[name] = buf
                chosen = buf
            direct[name] = chosen
            for _, d in dests:
                if d is not chosen:
                    copies.append((d, chosen))
        if cuda_dev is None:
            # (The engine takes each destination's memory as a DLPack capsule.)
            self.shared.engine.load_into(s, [(name, _util.dest_capsule(d)) for name, d in direct.items()])
        else:
            device_dest = [(name, d, cuda_dev.index) for name, d in direct.items()]
            torch.cuda.current_stream(cuda_dev).synchronize()
            if remote:
                _remote.read_into_device(self.shared, s, device_dest)
            else:
                self.shared.engine.load_into_device(s, [(n, _util.dest_capsule(d), i) for n, d, i in device_dest])
        with torch.no_grad() if torch is not None else contextlib.nullcontext():
            for d, src in copies:
                if isinstance(d, np.ndarray):
                    # (numpy converts to the destination's byte order)
                    d[...] = src.cpu().numpy() if not isinstance(src, np.ndarray) else src
                    continue
                if isinstance(src, np.ndarray):
                    src = torch.from_numpy(src)
                if d.is_inference():  # (updated in place only in inference mode)
                    with torch.inference_mode():
                        d.copy_(src)
                else:
                    d.copy_(src)


Leaf = _state.Leaf


def _unnamed_subtrees(tree: Any, target: Any) -> set:
    """The checkpoint names (stored and aliases) under top-level containers of the saved
    state whose key ``target`` (a mapping) does not have: ``load_into`` does not report
    them as unexpected. Empty when either side is not a dict (or the checkpoint has no
    skeleton: a flat file's tensors are all top-level)."""
    if not isinstance(target, Mapping) or not isinstance(tree, dict):
        return set()
    if tree.get("t") not in ("dict", "odict"):
        return set()
    named = set()
    for k in target.keys():
        if isinstance(k, int) and not isinstance(k, bool):
            named.add(("i", str(k)))
        elif isinstance(k, str):
            named.add(("s", k))
    out: set = set()
    for kt, k, child in tree.get("v", []):
        if (kt, str(k)) in named or not isinstance(child, dict):
            continue
        if child.get("t") in ("dict", "odict", "list", "tuple"):
            out.update(n["n"] for n in _state.tensor_nodes(child))
    return out


def _dest_dtype_name(lf: Any) -> str:
    return lf.dtype


def _unwritable(d: Any) -> Optional[str]:
    """Why ``load_into`` cannot write destination ``d`` (checked before any byte is written),
    or ``None``."""
    if isinstance(d, np.ndarray):
        if not d.flags.writeable:
            return "is a read-only numpy array"
        return None
    if torch._debug_has_internal_overlap(d) == 1:  # 1: MemOverlap::Yes
        return "has elements that share memory (an expanded view): it cannot be written"
    return None
