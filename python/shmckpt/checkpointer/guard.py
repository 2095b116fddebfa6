"""``Checkpointer.guard``: an optimizer's ``step()`` waits for the saves still staging.
:class:`Guard` holds the hooks; the saver asks it which storages are guarded."""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Mapping, Tuple

from .._util import _storage_key
from .base import Shared
from .handle import SaveHandle
from .. import _layout, _snapshot

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]


class Guard:
    """The optimizer guards of one :class:`~shmckpt.Checkpointer`: its ``guard`` and
    ``unguard`` delegate here, and its saver asks :meth:`storages` which memory a guard
    protects."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        # (weakref to optimizer, step pre-hook, load_state_dict pre-hook, finalizer)
        self.hooks: List[Tuple[Any, Any, Any, Any]] = []
        #: Called when what a guard protects may change (a guard added or removed, a
        #: guarded optimizer's ``load_state_dict`` or its end): the saver drops what it
        #: prepared for the next save (``Saver.drop_prepared``).
        self.changed: List[Callable[[], None]] = []

    def _changed(self) -> None:
        for fn in list(self.changed):
            fn()

    def active(self) -> bool:
        """Whether some optimizer is guarded."""
        return bool(self.hooks)

    def remove_all(self) -> None:
        """Remove every guard (``close``)."""
        for entry in self.hooks:
            _remove(entry)
        self.hooks.clear()
        self._changed()

    # -- guard -------------------------------------------------------------------------
    def guard(self, optimizer: Any) -> None:
        """Make ``optimizer.step()`` first wait until every save of this checkpointer has
        copied its bytes. For saves of CUDA tensors the wait ends on the device: the hook
        returns once the engine has queued its last copies (it keeps them at most
        ``Tuning.copy_ahead`` bytes ahead of their completion), and the current stream of
        each device waits for them, so the optimizer's kernels run after the copies while
        the trainer's thread goes on (``Tuning(stream_latches=True)``: the streams wait on a
        latch the engine opens behind its last copies, and the hook returns at once); other
        saves are waited for on the host (``wait_staged``).

        With a guard, ``save(..., blocking=False)`` copies the optimizer's parameters and
        state in the background while the trainer runs its next forward and backward; every
        other tensor of the state (buffers such as BatchNorm running statistics, tensors of
        unguarded optimizers, numpy arrays) is captured at the call. Parameters and state of
        a guarded optimizer must not be changed other than by its ``step()`` (or after the
        handle's ``wait_staged()``). A save of the same guarded tensors as the previous
        save is also captured off the caller's thread, and ``step()`` first waits for that
        capture (docs/python.md, "Non-blocking saves and guard").
        """
        ref = weakref.ref(optimizer)
        me = weakref.ref(self)

        def pre_hook(opt: Any, args: Any, kwargs: Any) -> None:
            g = me()
            if g is not None:
                g.wait()

        def changed(*_: Any) -> None:
            g = me()
            if g is not None:
                g._changed()

        hook = optimizer.register_step_pre_hook(pre_hook)
        loading = optimizer.register_load_state_dict_pre_hook(changed)
        gone = weakref.finalize(optimizer, changed)
        self.hooks.append((ref, hook, loading, gone))
        self._changed()

    def unguard(self, optimizer: Any) -> None:
        """Remove the guard of ``optimizer``."""
        keep = []
        for entry in self.hooks:
            if entry[0]() is optimizer:
                _remove(entry)
            else:
                keep.append(entry)
        self.hooks = keep
        self._changed()

    def fingerprint(self) -> Tuple[Any, ...]:
        """What changes when the set of guarded tensors may have: a guard added or removed,
        an optimizer's ``state`` or ``param_groups`` replaced (``load_state_dict``) or grown
        (a parameter's first step, ``add_param_group``). Cheap (no tensor is read): a save
        is deferred only while it is the last deferrable save's (``Saver.save``)."""
        out: List[Any] = []
        for ref, hook, _, _ in self.hooks:
            opt = ref()
            if opt is None:
                out.append(None)
                continue
            st, groups = opt.state, opt.param_groups
            out.append((id(hook), id(opt), id(st), len(st), id(groups), len(groups)))
        return tuple(out)

    def storages(self) -> set:
        """The storage keys (``_util._storage_key``) of every parameter and state tensor of
        the guarded optimizers."""
        tensors = []
        for ref, _, _, _ in self.hooks:
            opt = ref()
            if opt is None:
                continue
            for g in opt.param_groups:
                tensors.extend(g["params"])
            tensors.extend(
                [
                    v
                    for st in opt.state.values()
                    if type(st) is dict or isinstance(st, Mapping)
                    for v in st.values()
                    if isinstance(v, torch.Tensor)
                ]
            )
        return _layout.guard_keys(tensors, _storage_key)

    def wait(self) -> None:
        """The guard's wait before an optimizer step. A save whose bytes the engine copies
        itself from CUDA tensors is waited for on the device: once its host bytes are copied
        and its last device copies queued (at most ``Tuning.copy_ahead`` bytes before the
        copy's end), the current stream of each of its devices waits for those copies
        (``cuStreamWaitEvent``), and the trainer's thread goes on queueing the optimizer
        step and the next forward. With ``Tuning(stream_latches=True)`` (where the driver
        allows stream memory operations) the hook does not wait on the host: the streams
        wait on the save's latch (``cuStreamWaitValue32``), which the engine opens behind
        its last copies (or from the host if the save fails first). Other saves are waited
        for on the host (``wait_staged``)."""

        def wait(h: SaveHandle) -> Any:
            if h._deferred:
                if h._snapshot:
                    _snapshot.request_early(h._started)
                try:
                    h._get_rust()  # the capture (milliseconds after the call)
                except Exception:
                    return None  # nothing reads the tensors; the next save or wait raises it
            if not h._devices or (h._future is not None and not h._deferred) or h._keep is None:
                return h.wait_staged()
            streams = [(d, torch.cuda.current_stream(d)) for d in h._devices]
            n = _snapshot.hold(h._get_rust(), h._snapshot, streams)
            h.snapshot_bytes = max(h.snapshot_bytes, n)
            h._poll()
            return None

        self.shared.wait_all(wait)


def _remove(entry: Tuple[Any, Any, Any, Any]) -> None:
    """Remove one guard's hooks (``Guard.hooks``): its finalizer is detached, not run."""
    _, hook, loading, gone = entry
    hook.remove()
    loading.remove()
    gone.detach()
