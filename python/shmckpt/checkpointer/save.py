"""``Checkpointer.save``: flatten the state and hand its tensors to the engine (:class:`Saver`)."""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .. import _layout, _state
from .._util import _cuda_span_copy, _gc_paused, _gc_paused_call, _host_tuple, _storage_key, engine_tuples
from ..errors import CommitRefused, SaveFailed
from .base import Shared, _step_int
from .guard import Guard
from .handle import SaveHandle
from .. import _snapshot

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]


class Saver:
    """The saves of one :class:`~shmckpt.Checkpointer`: its ``save``, ``wait`` and
    ``wait_staged`` delegate here. Holds the layout of the last save (reused when the next
    state matches, ``_layout.py``) and the thread that submits saves whose host copies of
    device tensors are still in flight."""

    def __init__(self, shared: Shared, guard: Guard) -> None:
        self.shared = shared
        self.guard = guard
        #: ``_layout.Layout`` of the last save, reused when it matches.
        self.layout: Optional[Any] = None
        self.submitter: Optional[concurrent.futures.ThreadPoolExecutor] = None
        #: A speculative start with a snapshot is asked for it before its check in the
        #: guard's wait (``_snapshot.request_early``); off: after the check, as before
        #: (for benches that compare the two).
        self.early_snapshot = True
        #: Set by a non-blocking save whose tensors were all guarded and read in place: the
        #: next save of tensors of the same storages is deferred (``_defer``).
        self.deferrable: Optional[_Again] = None
        #: The next deferred save's tensors, prepared by the check of the last one in the
        #: guard's hook (``_prepare_next``): (the plan they are the tuples of, the engine's
        #: ``PreparedTensors``). They keep the guarded storages referenced until the next
        #: save, ``close`` or a change of the guard (``drop_prepared``).
        self.prepared: Optional[Tuple[_layout.Plan, Any]] = None
        guard.changed.append(self.drop_prepared)

    def close(self) -> None:
        """Stop the submitting thread once its submissions ran (``close``)."""
        self.drop_prepared()
        if self.submitter is not None:
            self.submitter.shutdown(wait=True)
            self.submitter = None

    def drop_prepared(self) -> None:
        """Give the prepared tensors of the next deferred save back (their storages are
        referenced no more): the next save does not use them, the checkpointer closes, or
        the guard changes (``Guard.changed``)."""
        prepared, self.prepared = self.prepared, None
        if prepared is not None:
            prepared[1].release()

    def wait_staged(self) -> None:
        """Wait until every save in flight has copied its bytes. A failed save raises its
        error here once (and is then forgotten)."""
        self.shared.wait_all(SaveHandle.wait_staged)

    def wait(self) -> None:
        """Wait until every save in flight is committed (raises the first error, once)."""
        self.shared.wait_all(SaveHandle.wait)

    # -- save --------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        blocking: bool = True,
        metadata: Optional[Mapping[str, str]] = None,
        snapshot: Optional[str] = None,
    ) -> SaveHandle:
        """Save ``state`` (nested dict/list/tuple of tensors, arrays and plain values) as
        checkpoint ``step``.

        ``blocking=True`` returns once every byte is staged (the caller may then change its
        tensors); ``blocking=False`` returns at once (see :meth:`guard`). The checkpoint is
        committed in the background; ``handle.wait()`` waits for it. Unsupported values
        raise :class:`~shmckpt.errors.UnsupportedValue` (a ``TypeError``) naming their key
        path before anything is written. Values are saved, never bytes that read otherwise:
        big-endian arrays are stored little-endian, conjugate and negative views resolved.
        ``step`` is an int (never a bool).

        ``snapshot="device"`` (with ``blocking=False`` and :meth:`guard`): what is still
        being copied when the optimizer step starts is snapshotted device-to-device into a
        transient buffer outside torch's allocator, freed once copied
        (``handle.snapshot_bytes``; docs/python.md). The default allocates no device memory.

        Under a guard, a non-blocking save of the same tensors (the same storages) as the
        previous save, all guarded, is captured off the caller's thread: the call reads
        only the containers (their plain values included); its capture errors are raised
        by the next ``save`` or wait (docs/python.md, "Non-blocking saves and guard").
        """
        step = _step_int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        # A speculative save not checked yet (no optimizer step since its call) is checked
        # now: its check sets what this save reads (the layout, ``deferrable``).
        for h in list(self.shared.pending):
            h._settled()
        self._raise_deferred_failure()
        checker = self.shared.checker
        if checker is not None:
            # The earlier saves' replica checks first (collectives in save order): at most
            # one save's commit waits for its check at a time.
            checker.check_through(None)
        snap = _snapshot.device_mode(snapshot, blocking, self.guard.active())
        meta: Dict[str, str] = {}
        for k, v in (metadata or {}).items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"metadata must map str to str; got {k!r}: {type(v).__name__}")
            meta[k] = v
        if _state.STATE_KEY in meta:
            raise ValueError(f"metadata key {_state.STATE_KEY!r} is reserved")
        walked: Optional[_layout.Probe] = None
        again = self.deferrable
        if (
            again is not None
            and not blocking
            and checker is None
            and self.guard.active()
            and again.guard == self.guard.fingerprint()
        ):
            # The same tensors (storages) as the last save, every one guarded: only the
            # containers and the storages' addresses are read now (a later change of them
            # is not this save's); the tensors' metadata, the plan and the engine's call
            # follow on the submitting thread while the trainer goes on (the guard's wait
            # before the optimizer step waits for them).
            with _gc_paused():
                walked = _layout.walk(state)
            if walked is not None and again.matches(walked):
                return self._defer(step, walked, meta, snap, again)
        self.drop_prepared()
        self._join_deferred()
        return _gc_paused_call(self._capture_and_submit, step, state, walked, blocking, meta, snap, checker)

    def _capture_and_submit(
        self, step: int, state: Any, walked: Optional[_layout.Probe], blocking: bool, meta: Dict[str, str], snap: bool, checker: Any
    ) -> SaveHandle:
        """A save captured at its call (``save``, collections paused)."""
        probe = _layout.probe(state) if walked is None else _layout.read_meta(walked)
        cap = self._capture_tensors(step, state, probe, blocking, meta, None)
        return self._submit(step, cap, blocking, meta, snap, checker)

    def _raise_deferred_failure(self) -> None:
        """Raise (once) the error of a deferred save whose capture failed: it is reported
        at the next ``save`` or wait, never inside the optimizer's step."""
        for h in list(self.shared.pending):
            if h._unreported():
                self.shared.forget(h)
                assert h._future is not None
                err = h._future.exception()
                assert err is not None
                raise err

    def _join_deferred(self) -> None:
        """Wait until the deferred captures still running have run (they set the layout this
        thread is about to use); their errors are reported by their handles."""
        futures = [h._future for h in list(self.shared.pending) if h._deferred and h._future is not None]
        if futures:
            concurrent.futures.wait(futures)

    def _defer(self, step: int, walked: _layout.Probe, meta: Dict[str, str], snap: bool, again: "_Again") -> SaveHandle:
        """A save whose capture runs on the submitting thread (``save``): the events of the
        trainer's current streams are recorded now, so the engine's copies run after what
        was queued before this call, as a save captured at the call would."""
        streams = {d: torch.cuda.current_stream(d) for d in again.devices}
        events = _record_events(streams)
        keep: List[Any] = [walked.objs, list(streams.values()), list(events.values())]
        handle = SaveHandle(step, keep)
        handle._deferred = True
        handle._devices = list(again.devices)
        handle._replicator = self.shared.replicator
        handle._metadata = meta
        self.shared.reap()
        pinned = _Pinned(step, walked, meta, snap, streams, events, keep, handle)
        if self._speculate(pinned):
            self.shared.track(handle)
            return handle

        def capture() -> Any:
            try:
                return _gc_paused_call(self._capture_deferred, pinned)
            except BaseException:
                self.deferrable = None  # the next save is captured at its call
                raise

        handle._future = self._on_submitter(capture)
        self.shared.track(handle)
        return handle

    def _speculate(self, pinned: "_Pinned") -> bool:
        """Start a deferred save at its call (``_defer``) from the last save's plan: the
        plan's tuples over the call's tensors, the layout's skeleton with the call's plain
        values, copies ordered after the call's events. The engine's call runs on the
        submitting thread (:meth:`_start`), which holds the interpreter's lock only to
        pass the prepared tensors (or build the tuples) and the metadata: its work (the
        plan, the files, the staging thread) runs while the trainer queues the step's
        first kernels. The engine takes the save provisionally (``provisional=True``: no
        tier takes it before :meth:`_settle` confirms it) and refuses a tensor whose
        dtype, shape, length or device is not its tuple's. What the deferred capture would
        check (each tensor's metadata against the layout, the guarded storages) is checked
        by :meth:`_settle`, run by the guard's wait before the optimizer step (or by the
        first wait, ``done`` or the next save). False (nothing started) when the last save
        left no plan this call can use; the save is then captured on the submitting
        thread."""
        prepared, self.prepared = self.prepared, None
        if not self._speculate_with(pinned, prepared) and prepared is not None:
            prepared[1].release()
            return False
        return True

    def _speculate_with(self, pinned: "_Pinned", prepared: Optional[Tuple[_layout.Plan, Any]]) -> bool:
        """:meth:`_speculate`, given the tensors the last check prepared (``_prepare_next``;
        used when they are the tuples of the plan this save starts from: their memory is
        then the storages of this call's tensors, which its check compares). True once the
        start is queued: the start then owns ``prepared``."""
        walked, meta = pinned.walked, pinned.meta
        lay = self.layout
        plan = _startable(lay)
        if lay is None or plan is None:
            return False
        if lay.tokens != walked.tokens or sorted(pinned.streams) != plan.devices:
            return False
        if any(h._deferred and h._future is not None and not h._future.done() for h in list(self.shared.pending)):
            return False  # a capture still running on the submitting thread sets the layout
        skeleton = lay.skeleton_of(walked.vals)
        if skeleton is None:
            return False
        spec_meta = dict(meta)
        spec_meta[_state.STATE_KEY] = skeleton
        snapshot = pinned.snap and bool(plan.devices)
        usable = prepared if prepared is not None and prepared[0] is plan else None
        if prepared is not None and usable is None:
            prepared[1].release()
        started = self._on_submitter(
            functools.partial(_gc_paused_call, self._start, pinned, plan, usable, spec_meta, snapshot)
        )
        handle = pinned.handle
        handle._snapshot = snapshot
        fut: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
        handle._future = fut
        handle._settle = functools.partial(self._settle, pinned, plan, started, fut)
        if self.early_snapshot:
            handle._started = started
        return True

    def _start(
        self,
        pinned: "_Pinned",
        plan: _layout.Plan,
        prepared: Optional[Tuple[_layout.Plan, Any]],
        spec_meta: Dict[str, str],
        snapshot: bool,
    ) -> Any:
        """On the submitting thread: the engine's provisional save of a speculative start
        (:meth:`_speculate`), from the prepared tensors when given, else from the plan's
        tuples over the call's tensors. The engine's handle, or None when the engine
        refused the save (a tensor the plan no longer describes) or it could not start:
        nothing was started, and its check captures the save (:meth:`_settle`)."""
        after = _after_events(pinned.events)
        try:
            tensors: Any
            if prepared is not None and not prepared[1].taken:
                tensors = prepared[1]
            else:
                tensors = engine_tuples(plan.tuples(pinned.walked.objs))
            return self.shared.engine.save(pinned.step, tensors, spec_meta, after, False, False, snapshot, provisional=True)
        except Exception:
            return None
        finally:
            if prepared is not None:
                prepared[1].release()  # (a no-op once the save took them)

    def _settle(
        self,
        pinned: "_Pinned",
        plan: _layout.Plan,
        started: "concurrent.futures.Future[Any]",
        fut: "concurrent.futures.Future[Any]",
    ) -> None:
        """In the guard's hook: check a save :meth:`_speculate` started
        (:meth:`_check_started`), then prepare the next one (:meth:`_prepare_next`). Each
        with the cyclic GC paused until its frame, and the tuples it made for the save
        (several per tensor), are gone: collected while they lived, they were promoted to
        the oldest generation (~2 per tensor per save), and CPython then collected the
        trainer's whole heap every ~20 saves, on the thread that tripped it, holding the
        interpreter (~155 ms for 337,000 objects on the development VM)."""
        if _gc_paused_call(self._check_started, pinned, plan, started, fut):
            _gc_paused_call(self._prepare_next, pinned.walked)

    def _check_started(
        self,
        pinned: "_Pinned",
        plan: _layout.Plan,
        started: "concurrent.futures.Future[Any]",
        fut: "concurrent.futures.Future[Any]",
    ) -> bool:
        """Check a save :meth:`_speculate` started: capture the call's walk as a deferred
        save would (``_capture_tensors``: the tensors' metadata read now, the layout and
        plan compared, the guarded storages checked). When that capture is a hit of the plan
        the save was started from, the engine's save is exactly the capture's: the same
        layout (so the same skeleton for the walk's values), the same tuples over the same
        tensors, no copy made anew (the plan has none to redo) and the call's devices: its
        commit is confirmed. Else it is refused, and once it has ended the capture is saved
        as the deferred save (its copies after the call's events; the guard's wait then
        waits for them); so is the capture when the start (:meth:`_start`, waited for
        here) started nothing. ``fut`` gets the engine's handle of the save that stands,
        or the error (reported by the next save or wait, as a deferred capture's): False
        then."""
        step, walked, meta = pinned.step, pinned.walked, pinned.meta
        rust: Any = None
        try:
            rust = started.result()
            probe = _layout.read_meta(walked)
            cap = self._capture_tensors(step, walked, probe, False, meta, pinned)  # (paused: _settle)
            if rust is not None and cap.plan is plan:
                rust.confirm_commit(None)
                fut.set_result(rust)
            else:
                if rust is not None:
                    rust.confirm_commit("the state changed between the save's call and its check; it is saved again")
                    try:
                        rust.wait()
                    except CommitRefused:
                        pass
                fut.set_result(self._submit_deferred(cap, pinned))
        except BaseException as e:
            self.deferrable = None  # the next save is captured at its call
            if rust is not None:
                rust.confirm_commit(f"the save's check failed: {e}")
            fut.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return False
        return True

    def _prepare_next(self, walked: _layout.Probe) -> None:
        """After a check in the guard's hook (:meth:`_settle`), while the device still runs
        the step's queued work: when the next save may be deferred, check its tensors and
        take their capsules now (``Engine.prepare``: the plan's tuples over this save's
        tensors, whose storages the next deferred save has), so that its call only starts
        the engine's save. Nothing is prepared when that fails (the next save builds them)."""
        again, plan = self.deferrable, _startable(self.layout)
        if again is None or plan is None or again.devices != plan.devices:
            return
        try:
            prepared = self.shared.engine.prepare(engine_tuples(plan.tuples(walked.objs)))
        except Exception:
            return
        self.drop_prepared()
        self.prepared = (plan, prepared)

    def _capture_deferred(self, pinned: "_Pinned") -> Any:
        """A deferred save's capture and hand-off (``_defer``, collections paused)."""
        probe = _layout.read_meta(pinned.walked)
        cap = self._capture_tensors(pinned.step, pinned.walked, probe, False, pinned.meta, pinned)
        return self._submit_deferred(cap, pinned)

    def _on_submitter(self, fn: Any) -> "concurrent.futures.Future[Any]":
        """Run ``fn`` on the checkpointer's submitting thread (started at first use; one
        thread, so submissions run in save order)."""
        if self.submitter is None:
            self.submitter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shmckpt-submit")
        return self.submitter.submit(fn)

    def _capture_tensors(
        self,
        step: int,
        state: Any,
        probe: Optional[_layout.Probe],
        blocking: bool,
        meta: Dict[str, str],
        pinned: Optional["_Pinned"],
    ) -> "_Captured":
        """Flatten (or match the layout of) the state, put its skeleton in ``meta``, and
        capture each tensor as the engine takes it (``_capture``): read in place, held on
        the trainer's streams, or copied. Caches the layout and its plan for the next save
        and decides whether the next save may be deferred (``self.deferrable``). On the
        caller's thread ``pinned`` is None (then :meth:`_submit` follows); a deferred
        capture (:meth:`_defer`) passes its call's streams and events, ``state`` is the
        call's walk (``_layout.walk``), and ``SaveFailed`` is raised when the state no
        longer is what let the save be deferred (then :meth:`_submit_deferred`)."""
        # The layout of the previous save is reused when this state has the same
        # structure, plain value types and tensor metadata (_layout.py), its skeleton
        # given this state's plain values; else the state is flattened.
        lay = self.layout
        leaves: Optional[List[_state.Leaf]] = None  # built on a hit only when needed
        new_layout = False  # a layout made here: cached once the save is captured
        hit = lay.skeleton_for(probe) if lay is not None else None
        if hit is not None:
            assert probe is not None
            skeleton = hit
        else:
            # A deferred capture flattens the containers as its call walked them (``state``
            # is that walk), not as they are now.
            flat = _state.flatten(_layout.rebuild(state) if pinned is not None else state)
            leaves = flat.leaves
            self.layout = None
            lay = _layout.Layout.of(probe, flat)
            skeleton = lay.skeleton if lay is not None else _state.encode(flat)
            new_layout = lay is not None
            del flat
        meta[_state.STATE_KEY] = skeleton
        if pinned is None:
            self.shared.reap()

        # The guard's fingerprint before its tensors are read (what a deferral relies on).
        fp = self.guard.fingerprint() if (not blocking and self.guard.active()) else ()
        guarded = self.guard.storages() if fp else set()
        member = _layout.membership(probe, leaves, guarded, _storage_key) if guarded else None
        # A non-blocking save with no guard captures CUDA tensors by holding the trainer's
        # streams: the engine queues its copies (into its registered staging) before the
        # call returns, and the streams wait for them on the device, so the next kernels
        # run after them. One device-to-host copy, no pinned host copy, and the trainer's
        # thread waits only while the copies are queued. Only when every CUDA tensor is
        # contiguous and not a conjugate or negative view (a strided or lazy one is
        # captured by a pinned copy of its span, below, which the engine can read only
        # after it finished).
        hold = not blocking and not guarded and (lay.holdable if lay is not None else _layout.holdable(leaves or []))
        if pinned is not None and (hold or not member or not all(member)):
            raise SaveFailed(
                f"save of step {step}: a tensor of the state is no longer in a guarded optimizer "
                "(it was at the previous save); its bytes may have changed since the call",
                step=step,
            )
        # Engine tuples (name, dtype, shape, memory, nbytes, device; the memory a tensor or
        # array, made a DLPack capsule at the call, None for no bytes; device -1 for host
        # memory) and what keeps their memory alive.
        cap = _Captured(
            keep=[] if pinned is None else pinned.keep,
            devices={} if pinned is None else dict(pinned.streams),
            hold=hold,
        )
        keep, devices, finishes = cap.keep, cap.devices, cap.finishes
        key = (blocking, hold, member)
        plan = lay.plan if lay is not None else None
        new_plan: Optional[_layout.Plan] = None
        if plan is not None and plan.key == key:
            # Same layout, same mode: the tuples of the tensors staged from their own memory
            # are those of the last save (their metadata and addresses were compared), each
            # given its tensor now (the plan keeps none); the probe's storages keep that
            # memory alive. Copies are made anew.
            assert lay is not None and probe is not None
            entries = plan.tuples(probe.objs)
            cap.plan = plan
            keep.append(probe.storages)
            for d in plan.devices:
                if d not in devices:  # a deferred capture keeps the streams of its call
                    devices[d] = torch.cuda.current_stream(d)
            for e, i in plan.redo:
                lf = lay.leaf(i, probe.objs[i])
                entry, k, finish, _ = _capture(lf, blocking, bool(member and member[i]), hold, devices)
                entries[e] = entry
                keep.append(k)
                if finish is not None:
                    finishes.append((e, finish))
        else:
            if leaves is None:
                assert lay is not None and probe is not None
                leaves = lay.leaves(probe.objs)
            entries = []
            redo: List[Tuple[int, int]] = []
            own: List[Tuple[int, int]] = []
            for i, lf in enumerate(leaves):
                if lf.alias_of is not None:
                    continue  # an alias: its bytes are those of an earlier leaf
                entry, k, finish, direct = _capture(lf, blocking, bool(member and member[i]), hold, devices)
                (own if direct else redo).append((len(entries), i))
                if finish is not None:
                    finishes.append((len(entries), finish))
                entries.append(entry)
                keep.append(k)
            if lay is not None and probe is not None and _layout.fits(probe, lay, entries, own, sorted(devices)):
                new_plan = _layout.Plan(key, _layout.templates(entries), redo, sorted(devices), own)
        del leaves
        cap.entries = entries
        # What this save flattened and captured read the state after its probe (another
        # thread may have changed it meanwhile): Layout.of and _layout.fits keep only what
        # the probe's metadata gives, so a later save matching the probe writes what a
        # fresh save would (never a changed state's dtypes, values or addresses).
        if new_plan is not None:
            assert lay is not None
            lay.plan = new_plan
        if new_layout:
            self.layout = lay
        # The next non-blocking save of the same tensors may be deferred when this one had
        # every tensor guarded and read in place (no host copy, no array, no copy made now).
        again = None
        if not blocking and not hold and member and all(member) and not finishes and lay is not None:
            cur = lay.plan
            if cur is not None and cur.key == key and not cur.redo and probe is not None and probe.tensor_pos is None:
                again = _Again(probe, cur.devices, fp)
        self.deferrable = again
        return cap

    def _submit_deferred(self, cap: "_Captured", pinned: "_Pinned") -> Any:
        """A deferred capture's hand-off: the engine's copies ordered after the events its
        call recorded. ``SaveFailed`` when the capture needs what the call could not give
        (a pinned host copy, another device)."""
        step = pinned.step
        if cap.finishes or sorted(cap.devices) != sorted(pinned.streams):
            raise SaveFailed(
                f"save of step {step}: the state's tensors changed since the call (moved to another "
                "device, or now read through a pinned host copy); nothing of the step was saved",
                step=step,
            )
        handle = pinned.handle
        handle._snapshot = pinned.snap and bool(cap.devices)
        after = _after_events(pinned.events)
        return self.shared.engine.save(
            step, engine_tuples(cap.entries), pinned.meta, after, False, False, handle._snapshot, confirm=False
        )

    def _submit(
        self, step: int, cap: "_Captured", blocking: bool, meta: Dict[str, str], snap: bool, checker: Any
    ) -> SaveHandle:
        """Hand a save captured at its call to the engine, the way its mode needs: blocking
        (after its host copies), holding the trainer's streams, after events recorded now,
        or (host copies of device tensors in flight) from the submitting thread once they
        are done. Returns the save's handle, tracked unless blocking."""
        confirm = checker is not None
        entries, keep, devices, finishes = cap.entries, cap.keep, cap.devices, cap.finishes
        keep.extend(devices.values())
        handle = SaveHandle(step, keep)
        handle._replicator = self.shared.replicator
        if checker is not None:
            handle._checker = checker
            checker.add(handle)
        handle._metadata = meta  # node-local roots: the manifest's, committed through the group
        if not finishes:
            handle._devices = sorted(devices)

        def finish_host_copies() -> None:
            for i, fin in finishes:
                e = entries[i]
                h = fin()
                entries[i] = _host_tuple(e[0], e[1], h)
                keep.append(h)

        if blocking:
            if finishes:
                for st in devices.values():
                    st.synchronize()  # this stream only, not the device
                finish_host_copies()
            after = [(d, "stream", st) for d, st in devices.items()]
            h = self.shared.engine.save(step, engine_tuples(entries), meta, after, True, confirm=confirm)
            handle._set_rust(h)
            handle._release()
        elif cap.hold:
            # The engine records each stream when it starts (it returns only once its copies
            # are queued and the streams wait for them, so nothing was queued after the call).
            after = [(d, "stream", st) for d, st in devices.items()]
            h = self.shared.engine.save(step, engine_tuples(entries), meta, after, False, True, confirm=confirm)
            handle._set_rust(h)
            self.shared.track(handle)
            return handle
        else:
            # Order the device copies after the work queued at this call: an event recorded
            # now on each device's current stream. (A stream handed to the engine would be
            # recorded by its staging thread, later, after the trainer's next kernels.)
            events = _record_events(devices)
            keep.extend(events.values())
            after = _after_events(events)
            if not finishes:
                handle._snapshot = snap and bool(devices)
                h = self.shared.engine.save(
                    step, engine_tuples(entries), meta, after, False, False, handle._snapshot, confirm=confirm
                )
                handle._set_rust(h)
                self.shared.track(handle)
                return handle

            # Host copies of device tensors are in flight on the trainer's streams: wait for
            # the events off the caller's thread, then start the save.
            def submit() -> Any:
                for ev in events.values():
                    ev.synchronize()
                finish_host_copies()
                return self.shared.engine.save(step, engine_tuples(entries), meta, after, False, confirm=confirm)

            handle._future = self._on_submitter(submit)
        self.shared.track(handle)
        return handle


class _Captured:
    """A save's tensors as the engine takes them (``Saver._capture_tensors``): the engine
    tuples, what keeps their memory alive, the CUDA devices and their streams, the pinned
    host copies still in flight (index in ``entries``, finish), whether the trainer's
    streams are held, and the plan the tuples came from."""

    __slots__ = ("entries", "keep", "devices", "finishes", "hold", "plan")

    def __init__(self, keep: List[Any], devices: Dict[int, Any], hold: bool) -> None:
        self.entries: List[Tuple[str, str, List[int], Any, int, int]] = []
        self.keep = keep
        self.devices = devices
        self.finishes: List[Tuple[int, Any]] = []
        self.hold = hold
        #: The cached plan whose tuples these are (a layout and plan hit), else None.
        self.plan: Optional[_layout.Plan] = None


def _startable(lay: Optional[_layout.Layout]) -> Optional[_layout.Plan]:
    """The plan of layout ``lay`` that a deferred save can start from at its call
    (``Saver._speculate``) and prepare for (``Saver._prepare_next``): a non-blocking save's
    that did not hold the trainer's streams and captures nothing anew (every tuple is a
    tensor's own memory); else None."""
    plan = lay.plan if lay is not None else None
    if plan is None or plan.redo or plan.key[0] or plan.key[1]:
        return None
    return plan


def _record_events(streams: Dict[int, Any]) -> Dict[int, Any]:
    """A CUDA event recorded now on each device's stream: what the engine's copies wait
    for, so they run after the work queued before the save's call."""
    events = {}
    for d, st in streams.items():
        ev = torch.cuda.Event()
        ev.record(st)
        events[d] = ev
    return events


def _after_events(events: Dict[int, Any]) -> List[Tuple[int, str, Any]]:
    """The engine's ``after`` for copies ordered after ``events`` (:func:`_record_events`)."""
    return [(d, "event", ev) for d, ev in events.items()]


class _Again:
    """What lets the next non-blocking save be deferred (``save``): the address of the
    storage of each tensor of the last save (each guarded and staged from its own memory;
    plain ints: nothing is kept alive), the containers' tokens, the CUDA devices and the
    guard's fingerprint, taken before the guarded storages were read
    (``Guard.fingerprint``)."""

    __slots__ = ("storages", "tokens", "devices", "guard")

    def __init__(self, probe: _layout.Probe, devices: List[int], guard: Tuple[Any, ...]) -> None:
        storages = _layout.storage_addresses(probe)
        assert storages is not None  # every leaf a tensor, its metadata read
        self.storages = storages
        self.tokens = probe.tokens
        self.devices = list(devices)
        self.guard = guard

    def matches(self, p: _layout.Probe) -> bool:
        """Whether walk ``p`` has the same containers and, at each leaf, a tensor of the
        same storage: the same tensor objects, or new views of the same memory (what
        ``model.state_dict()`` gives at every call). Only the storages are read."""
        if p.tokens != self.tokens or len(p.objs) != len(self.storages):
            return False
        return _layout.storage_addresses(p) == self.storages


class _Pinned:
    """A deferred save's call: its step, the walk of its state (``_layout.walk``), its
    metadata (the skeleton added by its capture), whether it asked for a device snapshot,
    the trainer's current stream and an event recorded on it per device, the handle's keep
    list and the handle."""

    __slots__ = ("step", "walked", "meta", "snap", "streams", "events", "keep", "handle")

    def __init__(
        self,
        step: int,
        walked: _layout.Probe,
        meta: Dict[str, str],
        snap: bool,
        streams: Dict[int, Any],
        events: Dict[int, Any],
        keep: List[Any],
        handle: SaveHandle,
    ) -> None:
        self.step = step
        self.walked = walked
        self.meta = meta
        self.snap = snap
        self.streams = streams
        self.events = events
        self.keep = keep
        self.handle = handle


def _capture(
    lf: _state.Leaf, blocking: bool, is_guarded: bool, hold: bool, devices: Dict[int, Any]
) -> Tuple[Tuple[str, str, List[int], Any, int, int], Any, Any, bool]:
    """How ``save`` hands leaf ``lf`` (not an alias) to the engine: its engine tuple, what
    keeps the tuple's memory alive, the ``finish`` of a pinned host copy still in flight
    (else None), and whether the tuple addresses the leaf's own memory (then it is the same
    at the next save of the same layout and mode; else it addresses a copy made now).
    ``is_guarded``: the leaf's memory belongs to a guarded optimizer. Adds the current
    stream of a CUDA leaf's device to ``devices``."""
    x = lf.obj
    if lf.kind == "ndarray":
        # C-contiguous and little-endian (a big-endian array is converted: its values are
        # stored, never its bytes); captured at the call unless blocking.
        a = _state.host_array(x, fresh=not blocking)
        return _host_tuple(lf.name, lf.dtype, a), a, None, False
    own = True
    if lf.lazy and x.is_cpu:
        # A conjugate or negative view: its memory is not its values. Store the values (a
        # new tensor, so nothing of the caller's is read later).
        x = _state.resolved(x.detach())
        own = False
        is_guarded = False  # a new tensor: no optimizer's
    if x.is_cpu:  # (device.type == "cpu", faster)
        if blocking:
            # Contiguous: staged from the caller's tensor as it is (no detach needed to
            # read its address); else a contiguous copy.
            if x.is_contiguous():
                t = x
            else:
                t, own = x.detach().contiguous(), False
        else:
            t = x.detach()
            if not is_guarded:
                t, own = t.clone(memory_format=torch.contiguous_format), False
            elif not t.is_contiguous():
                t, own = t.contiguous(), False
        nbytes = t.numel() * t.element_size()
        return (lf.name, lf.dtype, list(t.shape), t if nbytes else None, nbytes, -1), t, None, own
    t = x.detach()
    dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if dev not in devices:
        devices[dev] = torch.cuda.current_stream(dev)
    if t.numel() == 0:
        return (lf.name, lf.dtype, list(t.shape), None, 0, -1), t, None, True
    if t.is_contiguous() and (blocking or is_guarded or hold) and not lf.lazy:
        nbytes = t.numel() * t.element_size()
        return (lf.name, lf.dtype, list(t.shape), t, nbytes, dev), t, None, True
    with torch.cuda.device(dev):
        pinned, finish = _cuda_span_copy(t)
    return (lf.name, lf.dtype, list(t.shape), None, 0, -1), [t, pinned], finish, False
