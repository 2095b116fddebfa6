"""``save(..., snapshot="device")`` (issue 24): what a guarded non-blocking save still copies
when the optimizer step starts is snapshotted device-to-device into a transient buffer
outside torch's allocator, freed once copied. The argument checks and the guard's order
of calls run on CPU; the snapshot itself needs a GPU (marker ``gpu``)."""

import pytest
import torch

import shmckpt
from shmckpt import _snapshot
from shmckpt.errors import ConfigError


def adamw(device, n=4, numel=1 << 10, seed=24):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(n)]
    opt = torch.optim.AdamW(params, lr=0.1, fused=(device == "cuda"))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, opt


def test_snapshot_argument_checks_come_before_anything_is_saved(ck):
    params, opt = adamw("cpu")
    state = {"p": params}
    with pytest.raises(ValueError, match="snapshot must be"):
        ck.save(1, state, blocking=False, snapshot="host")
    with pytest.raises(TypeError, match="snapshot must be"):
        ck.save(1, state, blocking=False, snapshot=True)
    with pytest.raises(ConfigError, match="guarded optimizer"):
        ck.save(1, state, blocking=False, snapshot="device")
    ck.guard(opt)
    with pytest.raises(ValueError, match="non-blocking"):
        ck.save(1, state, snapshot="device")
    ck.flush()
    assert ck.list() == []
    # The default and "none" are accepted with or without blocking.
    ck.save(1, state, snapshot="none").wait()
    ck.save(2, state, blocking=False, snapshot=None).wait()
    assert ck.list() == [1, 2]


def test_snapshot_device_on_host_tensors_saves_exact_bytes_and_reports_no_device_bytes(ck):
    params, opt = adamw("cpu")
    ck.guard(opt)
    ref = [p.detach().clone() for p in params]
    ref_m = [opt.state[p]["exp_avg"].clone() for p in params]
    h = ck.save(1, {"p": params, "o": opt.state_dict()}, blocking=False, snapshot="device")
    opt.step()  # the guard waits on the host for host tensors: no snapshot
    rep = h.wait()
    assert rep["snapshot_bytes"] == 0 and h.snapshot_bytes == 0
    back = ck.load(1)
    for i in range(4):
        assert torch.equal(back["p"][i], ref[i])
        assert torch.equal(back["o"]["state"][i]["exp_avg"], ref_m[i])
        assert not torch.equal(params[i].detach(), ref[i])


class FakeRust:
    """Records the guard's calls to the extension's save handle."""

    def __init__(self, nbytes):
        self.calls = []
        self.nbytes = nbytes

    def request_snapshot(self):
        self.calls.append("request_snapshot")

    def hold_streams(self, streams):
        self.calls.append(("hold_streams", streams))

    def snapshot_bytes(self):
        self.calls.append("snapshot_bytes")
        return self.nbytes


def test_the_guard_asks_for_the_snapshot_before_holding_the_streams():
    r = FakeRust(3 << 20)
    assert _snapshot.hold(r, True, [(0, 1234)]) == 3 << 20
    assert r.calls == ["request_snapshot", ("hold_streams", [(0, 1234)]), "snapshot_bytes"]
    r = FakeRust(5)
    assert _snapshot.hold(r, False, [(1, 99)]) == 0
    assert r.calls == [("hold_streams", [(1, 99)])]


class Recorder:
    """The checkpointer's side of the guard's wait, for one handle: ``wait_all`` runs the
    wait on it."""

    def __init__(self, h):
        self.h = h

    def wait_all(self, wait):
        wait(self.h)


class StagedRust(FakeRust):
    def wait_staged(self):
        self.calls.append("wait_staged")
        return {}


def speculative_handle(rust, early):
    """A deferred save started speculatively with a snapshot: its provisional handle is
    ``rust``; its check (``_settle``) records itself in ``rust.calls`` and confirms it.
    ``early``: the saver handed the guard the start's future (``Saver.early_snapshot``)."""
    import concurrent.futures

    from shmckpt._handle import SaveHandle

    h = SaveHandle(7, [object()])
    h._deferred = True
    h._snapshot = True
    started = concurrent.futures.Future()
    started.set_result(rust)
    fut = concurrent.futures.Future()
    h._future = fut

    def settle():
        rust.calls.append("check")
        fut.set_result(rust)

    h._settle = settle
    h._started = started if early else None
    return h


def test_the_guard_asks_a_speculative_start_for_its_snapshot_before_the_check():
    """The check of a speculative save (the call's tensors read and compared, ~13 ms on an
    H100 at 1,168 tensors) runs in the guard's wait before the optimizer step; the
    snapshot's device copies are asked for first, so they run while the check does. With
    ``Saver.early_snapshot`` off, the check comes first, as before. (On CPU the handle has
    no device: the wait then waits on the host.)"""
    from shmckpt.checkpointer.guard import Guard

    r = StagedRust(0)
    h = speculative_handle(r, early=True)
    Guard.wait(type("G", (), {"shared": Recorder(h)})())
    assert r.calls == ["request_snapshot", "check", "wait_staged"]
    assert h._started is None  # the start's future is not kept past the check
    r = StagedRust(0)
    Guard.wait(type("G", (), {"shared": Recorder(speculative_handle(r, early=False))})())
    assert r.calls == ["check", "wait_staged"]
    # A start that made no save (the engine refused it): nothing to ask; the check saves
    # the capture instead.
    r = StagedRust(0)
    h = speculative_handle(None, early=True)
    h._settle = lambda: (r.calls.append("check"), h._future.set_result(r))
    Guard.wait(type("G", (), {"shared": Recorder(h)})())
    assert r.calls == ["check", "wait_staged"]


def device_used_outside_torch(sync=True):
    """Device bytes in use that torch's caching allocator did not reserve (``sync=False``:
    without waiting for the device, so while a save still copies)."""
    if sync:
        torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def aligned(n, a=256):
    return (n + a - 1) // a * a


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["device", None])
def test_snapshot_mode_saves_exact_bytes_and_gives_its_device_memory_back(root, mode):
    # 1.5 GiB of parameters and AdamW moments: the copy takes ~30 ms, far longer than the
    # time between the save call and the optimizer step below.
    params, opt = adamw("cuda", n=4, numel=32 << 20)
    state = {"p": params, "o": opt.state_dict()}
    tensors = params + [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq", "step")]
    device_bytes = sum(aligned(t.numel() * t.element_size()) for t in tensors)
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=2 << 30)) as ck:
        ck.prepare_cuda()
        ck.guard(opt)
        ref = [p.detach().cpu() for p in params]
        ref_m = [opt.state[p]["exp_avg"].cpu() for p in params]
        ref_v = [opt.state[p]["exp_avg_sq"].cpu() for p in params]
        before = device_used_outside_torch()
        h = ck.save(1, state, blocking=False, snapshot=mode)
        opt.step()  # the guard: a snapshot (mode "device"), then these kernels
        during = device_used_outside_torch(sync=False)
        rep = h.wait()
        after = device_used_outside_torch()
        back = ck.load(1)
        for i in range(4):
            assert torch.equal(back["p"][i], ref[i])
            assert torch.equal(back["o"]["state"][i]["exp_avg"], ref_m[i])
            assert torch.equal(back["o"]["state"][i]["exp_avg_sq"], ref_v[i])
            assert not torch.equal(params[i].detach().cpu(), ref[i])  # the step did run
        assert rep["snapshot_bytes"] == h.snapshot_bytes
        if mode == "device":
            # Everything but what was queued before the request (at most 256 MiB ahead).
            assert device_bytes - (256 << 20) - (8 << 20) <= h.snapshot_bytes <= device_bytes
            # Allocated outside torch's allocator while the save copied it ...
            assert during - before >= h.snapshot_bytes
        else:
            assert h.snapshot_bytes == 0
            assert during - before < (4 << 20)
        # ... and back on the device once the save is staged.
        assert after - before < (4 << 20)


@pytest.mark.gpu
def test_a_snapshot_save_is_staged_while_the_trainers_stream_is_still_busy(root):
    # The snapshot's memory goes back in its stream's order (cuMemFreeAsync), not with a
    # device-wide wait: before, freeing it synchronized the whole context, so the save was
    # staged only after every kernel the trainer had queued meanwhile, here a spin of ~1 s.
    params, opt = adamw("cuda", n=4, numel=16 << 20)
    state = {"p": params, "o": opt.state_dict()}
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=1 << 30)) as ck:
        ck.prepare_cuda()
        ck.guard(opt)
        ref = [p.detach().cpu() for p in params]
        before = device_used_outside_torch()
        h = ck.save(1, state, blocking=False, snapshot="device")
        opt.step()  # the guard: the snapshot is taken, the step's kernels follow it
        assert h.snapshot_bytes > 0
        torch.cuda._sleep(2_000_000_000)  # 2e9 cycles: ~1 s of spinning on its stream
        h.wait_staged()
        busy = not torch.cuda.current_stream().query()
        h.wait()
        assert busy, "the save waited for the trainer's kernels queued after it"
        after = device_used_outside_torch()
        assert after - before < (4 << 20), "the snapshot's memory came back"
        back = ck.load(1)
        for i in range(4):
            assert torch.equal(back["p"][i], ref[i])
