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
    with shmckpt.Checkpointer(root, staging_capacity=512 << 20) as ck:
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
    with shmckpt.Checkpointer(root, staging_capacity=512 << 20) as ck:
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
