"""A non-blocking save without a guard holds the trainer's stream (issue 24): the engine
queues its device-to-host copies before ``save`` returns and the stream waits for them, so
kernels queued right after the call may overwrite the tensors, and no pinned host copy of
the state is made."""

import pytest
import torch

import shmckpt


@pytest.mark.gpu
def test_kernels_after_an_unguarded_non_blocking_save_do_not_change_it(root):
    g = torch.Generator(device="cuda").manual_seed(24)
    x = torch.randn(64 << 20, device="cuda", generator=g)  # 256 MiB: the copy takes a while
    y = torch.randint(0, 255, (5, 1 << 20), device="cuda", dtype=torch.uint8, generator=g)
    ref = {"x": x.cpu(), "y": y.cpu()}
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=512 << 20)) as ck:
        ck.prepare_cuda()
        torch.cuda.synchronize()
        host_before = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
        h = ck.save(1, {"x": x, "y": y}, blocking=False)
        # Queued on the same stream right after the call: they must run after the copies.
        x.mul_(0).add_(1)
        y.zero_()
        host_during = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
        h.wait()
        back = ck.load(1)
        assert torch.equal(back["x"], ref["x"])
        assert torch.equal(back["y"], ref["y"])
        assert torch.equal(x, torch.ones_like(x))
        # No pinned host copy of the state (the path before took 261 MiB here).
        assert host_during - host_before < (1 << 20)


@pytest.mark.gpu
def test_the_guard_orders_the_optimizer_step_after_the_copies(root):
    torch.manual_seed(24)
    params = [torch.nn.Parameter(torch.randn(8 << 20, device="cuda")) for _ in range(4)]
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=512 << 20)) as ck:
        ck.prepare_cuda()
        ck.guard(opt)
        state = {"p": params, "o": opt.state_dict()}
        torch.cuda.synchronize()
        ref = {"p": [p.detach().cpu() for p in params],
               "m": [opt.state[p]["exp_avg"].cpu() for p in params]}
        h = ck.save(1, state, blocking=False)
        opt.step()  # the guard's hook: this step's kernels run after the save's copies
        after = [p.detach().cpu() for p in params]
        h.wait()
        back = ck.load(1)
        for i in range(4):
            assert torch.equal(back["p"][i], ref["p"][i])
            assert torch.equal(back["o"]["state"][i]["exp_avg"], ref["m"][i])
            assert not torch.equal(after[i], ref["p"][i])  # the step did run


@pytest.mark.gpu
def test_a_guard_waiting_for_staging_chunks_never_blocks_another_threads_look(root):
    """The guard's hold waits (GIL released) until every copy is queued, which lasts as
    long as the writers of the save before need to free its staging chunks.
    A thread asking ``staged()``/``done()`` meanwhile (with the GIL held) must get its
    answer at once: before the fix the hold kept the handle's lock through its wait, so
    that thread blocked with the GIL held until the hold returned."""
    import threading
    import time

    g = torch.Generator(device="cuda").manual_seed(24)
    # 4 GiB saved twice through room for one: the second save's copies are queued only as
    # the first one's writers free its chunks (over a second on any disk).
    params = [torch.nn.Parameter(torch.randn(64 << 20, device="cuda", generator=g)) for _ in range(16)]
    opt = torch.optim.SGD(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    ref = [p.detach().cpu() for p in params]
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=(4 << 30) + (64 << 20))) as ck:
        ck.prepare_cuda()
        ck.guard(opt)
        torch.cuda.synchronize()
        first = ck.save(1, {"p": params})  # staged; its writers drain it
        h = ck.save(2, {"p": params}, blocking=False)
        entered, held = threading.Event(), threading.Event()

        def step() -> None:
            entered.set()
            opt.step()  # the guard's hold: blocks until every copy of save 2 is queued
            held.set()

        t = threading.Thread(target=step)
        t.start()
        assert entered.wait(10)
        time.sleep(0.3)  # in the hold by now (it lasts as long as the drain, over a second)
        looks = []
        while not held.is_set() and len(looks) < 5:
            looks.append((h.staged(), h.done(), held.is_set()))
        t.join()
        first.wait()
        h.wait()
        # Answers came while the hold still waited (before the fix the first look
        # returned only after it).
        assert looks and looks[0] == (False, False, False)
        back = ck.load(2)
        for i in range(16):
            assert torch.equal(back["p"][i], ref[i])


@pytest.mark.gpu
def test_lazy_views_make_an_unguarded_non_blocking_save_not_hold(root):
    """Contiguous conjugate and negative views on CUDA are captured by pinned copies of
    their memory, their bits applied on the host once copied: such a state is not held (the
    held path took them as 0-byte tuples and the engine refused the save with a size
    mismatch); it is saved by value, at the first save and at the layout's reuse."""
    g = torch.Generator(device="cuda").manual_seed(24)
    z = torch.randn(1 << 12, dtype=torch.complex64, device="cuda", generator=g)
    x = torch.randn(1 << 12, device="cuda", generator=g)
    state = {"z": z.conj(), "x": torch._neg_view(x), "w": x}
    want = {"z": z.conj().resolve_conj().cpu(), "x": (-x).cpu(), "w": x.cpu()}
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20)) as ck:
        ck.prepare_cuda()
        for step in (1, 2):
            ck.save(step, state, blocking=False).wait()
            back = ck.load(step)
            assert sorted(back) == ["w", "x", "z"]
            for k, v in want.items():
                assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
                assert back[k].view(torch.uint8).tolist() == v.view(torch.uint8).tolist(), k
