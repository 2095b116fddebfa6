"""Part of train.py (the training-loop checkpoint benchmark; see its docstring and
README.md): the shared constants, small statistics helpers, and the model, optimizer and
trainer.  Imported by train.py after it puts benches/common and this directory on sys.path."""

import math
import statistics
import time

from peers import log, now


GiB = 1 << 30
MiB = 1 << 20
SYSTEMS = ["none", "torch", "dcp", "dcp-shm", "nvrx", "nvrx-fswa", "shm-block", "shm-async"]
CUDA_ONLY = {}  # every system runs on CPU in the smoke mode; filled if one cannot
COLOCATED_ORDER = ["none", "shm-async", "nvrx-fswa", "nvrx", "dcp", "dcp-shm", "shm-block", "torch"]

# model sizes: state = 12 bytes/param (fp32 weights, exp_avg, exp_avg_sq) + AdamW step scalars
SIZES = {
    "tiny": dict(d=64, layers=2, heads=2, vocab=512, seq=64, batch=2),
    # 8g's tensor count (1,168 with AdamW's moments) in a few MiB: the save call's cost on a CPU.
    "many": dict(d=64, layers=24, heads=2, vocab=512, seq=64, batch=2),
    "8g": dict(d=1536, layers=24, heads=12, vocab=32768, seq=1024, batch=4),
    "16g": dict(d=2048, layers=27, heads=16, vocab=32768, seq=1024, batch=4),
}


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = min(len(xs) - 1, max(0, int(math.ceil(q / 100.0 * len(xs))) - 1))
    return xs[k]


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ----------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------
def build_model(cfg, device, seed):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.tok = nn.Embedding(c["vocab"], c["d"])
            self.pos = nn.Embedding(c["seq"], c["d"])
            self.blocks = nn.ModuleList(Block(c["d"], c["heads"]) for _ in range(c["layers"]))
            self.lnf = nn.LayerNorm(c["d"])

        def forward(self, idx, tgt):
            T = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
            for b in self.blocks:
                x = b(x)
            logits = self.lnf(x) @ self.tok.weight.t()  # tied head
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    torch.manual_seed(seed)
    with torch.device(device):
        m = GPT(cfg)
    return m


def build_optimizer(model, device, fused):
    import torch

    kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    mode = fused
    if fused == "auto":
        mode = "fused" if device == "cuda" else "foreach"
    if mode == "fused":
        try:
            return torch.optim.AdamW(model.parameters(), fused=True, **kw), "fused"
        except Exception as e:
            log(f"fused AdamW unavailable ({e!r}); using foreach")
            mode = "foreach"
    return torch.optim.AdamW(model.parameters(), foreach=(mode == "foreach"), **kw), mode


def flat_state(model, opt):
    """The checkpointed state, the same dict for every system: references to
    the live tensors (no copies): model.<param name>, optim.<i>.<key>."""
    sd = {}
    idx = {}
    for i, (n, p) in enumerate(model.named_parameters()):
        sd[f"model.{n}"] = p.detach()
        idx[id(p)] = i
    for p, st in opt.state.items():
        i = idx[id(p)]
        for k, v in st.items():
            if hasattr(v, "detach"):
                sd[f"optim.{i}.{k}"] = v.detach()
    return sd


def spinner(device, window_ms, launch_bound=False):
    """The probes' forward and backward: a function that spends ``window_ms`` of device
    time on a CUDA ``device`` (a spin kernel, its cycles per ms calibrated here once), or
    sleeps that long on a CPU (the trainer's thread idle, as while a GPU computes).

    ``launch_bound``: instead, a fixed number of tiny in-place ops (calibrated here to take
    ``window_ms`` on an idle interpreter), issued from the trainer's thread: a forward whose
    thread is busy launching kernels, so that anything else holding the interpreter's lock
    lengthens it (on a GPU the step then waits for its launches)."""
    import torch

    if launch_bound:
        x = torch.zeros(16, device=device)
        for _ in range(200):  # warm-up
            x.add_(1.0)
        if device == "cuda":
            torch.cuda.synchronize()
        n, t = 2000, time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        if device == "cuda":
            torch.cuda.synchronize()
        per_op = (time.perf_counter() - t) / n
        ops = max(1, int(window_ms / 1e3 / per_op))

        def launch():
            for _ in range(ops):
                x.add_(1.0)

        return launch
    if device != "cuda":
        return lambda: time.sleep(window_ms / 1e3)
    # The spin counts clock cycles: calibrated on an idle GPU, whose clocks are still low,
    # it ran 51 ms instead of 192 at full clocks (H200, 2026-12-05). Raise the clocks first
    # (~0.5 s of spinning), then take the median rate of three timed spins.
    for _ in range(5):
        torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rates = []
    for _ in range(3):
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        rates.append(20_000_000 / a.elapsed_time(b))
    cycles = int(sorted(rates)[1] * window_ms)
    return lambda: torch.cuda._sleep(cycles)


def time_steps(tr, n):
    """The wall time of each of ``n`` steps of trainer ``tr`` (forward, backward, optimizer
    step, then ``tr.sync()``), in seconds."""
    dts = []
    for _ in range(n):
        t = now()
        tr.fwd_bwd()
        tr.step()
        tr.sync()
        dts.append(now() - t)
    return dts


def cadence_trainer(device, state, seed):
    """The trainer of the cadence benches (``cadence_overhead.py``, ``cadence_trace.py``):
    the ``state`` size on ``device`` (CUDA: device 0, TF32 matmuls), each step synchronized
    on its stream, three steps taken first (AdamW makes its moments at its first step, and
    the checkpointed state is weights and moments: 8g 8.2 GiB; built before any step it
    held the weights alone, 2.73 GiB)."""
    import torch

    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    tr = Trainer(dict(SIZES[state]), device, "auto", seed)
    tr.sync_mode = "stream"
    time_steps(tr, 3)
    return tr


def staging_capacity(nbytes, chunk, factor):
    """The cadence benches' staging: ``factor`` x a state of ``nbytes`` (a disk save
    draining, the held memory-only step, the save being staged), in whole chunks, plus 8."""
    return (int(nbytes * factor) + chunk - 1) // chunk * chunk + 8 * chunk


def state_nbytes(sd):
    return sum(t.numel() * t.element_size() for t in sd.values())


class Trainer:
    def __init__(self, cfg, device, fused, seed):
        import torch

        self.torch = torch
        self.cfg = cfg
        self.device = device
        self.model = build_model(cfg, device, seed)
        self.opt, self.opt_mode = build_optimizer(self.model, device, fused)
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed + 1)
        self.step_no = 0
        self.autocast = torch.autocast(device_type=device, dtype=torch.bfloat16)
        self.state = None

    def batch(self):
        c = self.cfg
        t = self.torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), device=self.device, generator=self.gen)
        return t[:, :-1], t[:, 1:]

    def fwd_bwd(self):
        x, y = self.batch()
        with self.autocast:
            loss = self.model(x, y)
        loss.backward()
        return loss

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1

    #: "device": torch.cuda.synchronize() (waits for every stream, a checkpointer's
    #: background copies included); "stream": the current stream only, as a trainer's
    #: ``loss.item()`` does.
    sync_mode = "device"

    def sync(self):
        if self.device == "cuda":
            if self.sync_mode == "stream":
                self.torch.cuda.current_stream().synchronize()
            else:
                self.torch.cuda.synchronize()

    def build_state(self):
        self.state = flat_state(self.model, self.opt)
        return self.state

    def params(self):
        return sum(p.numel() for p in self.model.parameters())
