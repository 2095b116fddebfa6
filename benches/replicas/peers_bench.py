"""Peer checkpoints side by side (issue 25): shmckpt's peer replicas, NVRx local
checkpointing with ``CliqueReplicationStrategy`` (replication factor 2) and torchft's
``PGTransport`` peer transfer, against the transport's own limit, in ONE process group.

    python benches/replicas/peers_bench.py --sizes 64MiB --rounds 1 --out /tmp/peers
    python benches/replicas/peers_bench.py --sizes 1GiB,4GiB --rounds 3 --out OUT [--device cuda]

It starts 4 ranks (this script, ``--role rank``) over gloo on 127.0.0.1: ranks 0-1 on
simulated machine "m0", ranks 2-3 on "m1"; partners i <-> i + 2 for every system (shmckpt's
ring plan, NVRx's cliques {0,2} and {1,3}, torchft's sender/receiver pairs). Each rank's
state is ``replica_bench.make_state`` (float32 pieces of at most 256 MiB, seeded by rank);
``--device cuda`` moves it to ``cuda:(rank % device_count)`` (one GPU: all ranks on GPU 0).

Per size, one warm-up round, then ``--rounds`` rounds; each round runs every system once,
in an order rotated by one each round (alternated). Every system does its two phases:

  transport  the limit: ``exchange``: every rank ``isend``s its state's bytes (the pieces)
             to its partner and ``irecv``s the partner's, same group, posted at once;
             ``one-way``: only m0's ranks send, m1's receive (what a restore moves;
             timed, as every restore, on the receivers: a sender's clock starts when
             it leaves the barrier, which can be well before its receiver).
  torchft    ``PGTransport`` on the same gloo group (device "cpu"): m0's ranks
             ``send_checkpoint`` their state to their partner, m1's ranks
             ``recv_checkpoint`` it (in place into preallocated tensors on CPU; for a CUDA
             state into fresh CPU tensors then copied to the GPU, inside the time). Compared
             against one-way (torchft has no replication phase: it is a live peer's state).
  shmckpt    ``Checkpointer(root, keep_in_memory=True, replicas=Replicas(k=1,
             node=m0/m1, bandwidth=None))``: ``save(blocking=False)`` to ``wait_replicated()``
             (k-safe: durable on disk, replica CRC-checked in the partner's /dev/shm), vs
             exchange; then machine m1 is lost: every rank closes its checkpointer, m1's
             ranks remove their kept arena, their files of every step and the replicas
             m1 held (exact names), all reopen (a restart), and m1's ranks' collective
             ``load`` (source ``("peer", partner)``) is timed, vs one-way.
  nvrx       ``LocalCheckpointManager`` per machine directory (``--nvrx-dir``, default
             under /dev/shm), ``CliqueReplicationStrategy`` over cliques {0,2},{1,3}:
             synchronous ``save`` (replicate + write own and partner's copy + barrier +
             validation) vs exchange; then m1's directory is removed, fresh managers (a
             restart), ``find_latest`` + ``load`` on m1's ranks timed, vs one-way. NVRx's
             ``BasicTensorAwareStateDict`` requires CUDA tensors, so it runs only with
             ``--device cuda``; its clique groups are NCCL (its retrieval sends CUDA
             tensors point to point), so it needs a GPU per rank (else SKIP, unless
             ``--nvrx-backend`` forces a backend).

Every restored or received state is compared with the saved one by SHA-256 of every
tensor's bytes (the sender's digests gathered): ``exact`` true/false per system. A system
that cannot run prints ``SKIP name: reason`` and has no numbers. Times are the slowest rank
of the phase (of m1's ranks for one-way and the restores). Writes ``peers.json`` (every sample) and ``peers.md`` (medians, min-max,
x the transport limit: limit seconds / system seconds per round) into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
sys.path.insert(0, HERE)

from peers import free_port, pkg_version  # noqa: E402  (benches/common/peers.py)

WORLD = 4
HALF = WORLD // 2
SYSTEMS = ("transport", "torchft", "shmckpt", "nvrx")
# system -> [(measure, what it is set against)]
MEASURES: Dict[str, List[Tuple[str, str]]] = {
    "transport": [("exchange_s", "exchange_s"), ("one_way_s", "one_way_s")],
    "torchft": [("transfer_s", "one_way_s")],
    "shmckpt": [("save_to_k_safe_s", "exchange_s"), ("peer_restore_s", "one_way_s")],
    "nvrx": [("save_to_replicated_s", "exchange_s"), ("peer_restore_s", "one_way_s")],
}


def parse_size(s: str) -> int:
    """``64MiB``, ``1GiB``, ``4g``, or a number of bytes."""
    t = s.strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def digests(state: Dict[str, Any]) -> Dict[str, str]:
    """SHA-256 of every tensor's bytes (on CPU), by name."""
    import torch

    out = {}
    for k, v in state.items():
        out[k] = hashlib.sha256(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data).hexdigest()
    return out


class Rank:
    """One rank's view: its group, partner, state and the samples it records."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        self.a, self.torch, self.dist = a, torch, dist
        self.me = a.rank
        self.partner = (self.me + HALF) % WORLD
        self.lost = self.me >= HALF
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
        dist.init_process_group("gloo", rank=self.me, world_size=WORLD, timeout=datetime.timedelta(seconds=a.timeout))
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=a.timeout))
        self.dev = "cpu"
        if a.device == "cuda":
            self.dev = f"cuda:{self.me % torch.cuda.device_count()}"
            torch.cuda.set_device(self.dev)
        self.samples: Dict[str, Dict[str, List[float]]] = {}
        self.exact: Dict[str, bool] = {}
        self.skips: Dict[str, str] = {}

    def gather(self, x: Any) -> List[Any]:
        out: List[Any] = [None] * WORLD
        self.dist.all_gather_object(out, x)
        return out

    def slowest(self, x: Optional[float]) -> float:
        """The slowest rank's seconds (ranks passing None take no part)."""
        return max(float(v) for v in self.gather(x) if v is not None)

    def agree_exact(self, system: str, ok: bool) -> None:
        self.exact[system] = self.exact.get(system, True) and all(self.gather(bool(ok)))

    def put(self, system: str, key: str, v: float) -> None:
        self.samples.setdefault(system, {}).setdefault(key, []).append(v)

    def sync(self) -> None:
        if self.dev != "cpu":
            self.torch.cuda.synchronize()
        self.dist.barrier()


def load_state(r: Rank, nbytes: int) -> Tuple[Dict[str, Any], Dict[int, Dict[str, str]]]:
    """This rank's state (on its device) and every rank's digests."""
    from replica_bench import make_state  # the same state replica_bench.py saves

    state = make_state(r.me, nbytes)
    mine = digests(state)
    if r.dev != "cpu":
        state = {k: v.to(r.dev) for k, v in state.items()}
    every = r.gather(mine)
    return state, {q: every[q] for q in range(WORLD)}


# ---- (c) the transport limit ---------------------------------------------------------


def host_bytes(state: Dict[str, Any]) -> List[Any]:
    """The state's pieces as host uint8 tensors (no copy for a CPU state)."""
    import torch

    return [v.detach().cpu().contiguous().view(-1).view(torch.uint8) for v in state.values()]


def transport_round(r: Rank, state: Dict[str, Any], dig: Dict[int, Dict[str, str]]) -> None:
    """A plain isend/irecv of the state's bytes with the partner: both ways, then m0 -> m1."""
    torch, dist = r.torch, r.dist
    out = host_bytes(state)
    names = list(state)
    ok = True
    for key, both in (("exchange_s", True), ("one_way_s", False)):
        sends = both or not r.lost
        recvs = both or r.lost
        inn = [torch.zeros_like(t) for t in out] if recvs else []  # pages touched before the clock
        dist.barrier(group=r.group)
        t0 = time.perf_counter()
        works = [dist.irecv(t, src=r.partner, group=r.group) for t in inn]
        if sends:
            works += [dist.isend(t, dst=r.partner, group=r.group) for t in out]
        for w in works:
            w.wait()
        dt = time.perf_counter() - t0
        # one-way: the slowest receiver, as every restore is timed
        r.put("transport", key, r.slowest(dt if recvs else None))
        if recvs:
            got = {n: hashlib.sha256(t.numpy().data).hexdigest() for n, t in zip(names, inn)}
            ok = ok and got == dig[r.partner]
        del inn
    r.agree_exact("transport", ok)


# ---- (b) torchft PGTransport ---------------------------------------------------------


def torchft_check() -> Optional[str]:
    try:
        from torchft.checkpointing.pg_transport import PGTransport  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the skip's reason
        return f"torchft is not importable ({type(e).__name__}: {e})"
    return None


def torchft_round(r: Rank, state: Dict[str, Any], dig: Dict[int, Dict[str, str]], step: int) -> None:
    """m0's ranks send their state to their partner with PGTransport; m1's receive it."""
    from torchft.checkpointing.pg_transport import PGTransport

    torch = r.torch
    to = datetime.timedelta(seconds=r.a.timeout)
    cpu_state = r.dev == "cpu"
    pre: Optional[Dict[str, Any]] = None
    if r.lost and cpu_state:
        pre = {k: torch.zeros_like(v) for k, v in state.items()}  # a live worker's own tensors (touched)
    tr = PGTransport(r.group, timeout=to, device=torch.device("cpu"), state_dict=(lambda: pre) if pre is not None else None)
    r.sync()
    t0 = time.perf_counter()
    got = None
    if r.lost:
        got = tr.recv_checkpoint(src_rank=r.partner, metadata=tr.metadata(), step=step, timeout=to)
        if not cpu_state:
            got = {k: v.to(r.dev) for k, v in got.items()}
            torch.cuda.synchronize()
    else:
        tr.send_checkpoint(dst_ranks=[r.partner], step=step, state_dict=state, timeout=to)
    dt = time.perf_counter() - t0
    r.put("torchft", "transfer_s", r.slowest(dt if r.lost else None))
    r.agree_exact("torchft", got is None or digests(got) == dig[r.partner])


# ---- (d) shmckpt peer replicas -------------------------------------------------------


class Shm:
    """shmckpt's checkpointer of this rank (kept in memory, one replica on the other machine)."""

    def __init__(self, r: Rank, root: str, nbytes: int) -> None:
        self.r, self.root, self.nbytes = r, root, nbytes
        self.step = 0
        self.ck = self.open()

    def open(self) -> Any:
        import shmckpt

        return shmckpt.Checkpointer(
            self.root,
            keep_in_memory=True,
            replicas=shmckpt.Replicas(k=1, node=f"m{self.r.me // HALF}", bandwidth=None, timeout=float(self.r.a.timeout)),
            tuning=shmckpt.Tuning(staging_capacity=self.nbytes + (64 << 20)),
        )

    def lose_machine_1(self) -> None:
        """Close every rank's checkpointer; m1's ranks remove what machine m1 held (their
        kept arena, their files of every step, the replicas of m0's ranks), by exact name."""
        from shmckpt import _shmckpt
        from shmckpt.replicas import remove_replica

        r = self.r
        name = self.ck.shm_name
        self.ck.close()
        r.dist.barrier()
        if r.lost:
            os.unlink(os.path.join("/dev/shm", name))
            for s in range(1, self.step + 1):
                d = os.path.join(self.root, f"step-{s}")
                if not os.path.isdir(d):
                    continue
                with open(os.path.join(d, "manifest.json")) as f:
                    man = json.load(f)
                for e in man["files"]:
                    f = os.path.join(d, e["file"])
                    if int(e["rank"]) == r.me and os.path.lexists(f):  # an earlier loss took the older ones
                        os.unlink(f)
            remove_replica(_shmckpt.replica_name(self.root, r.partner, self.step))
        r.dist.barrier()
        self.ck = self.open()

    def close(self) -> None:
        """Close, and remove this rank's kept arena and the replicas it holds."""
        from shmckpt import _shmckpt
        from shmckpt.replicas import list_replicas, remove_replica

        name = self.ck.shm_name
        self.ck.close()
        self.r.dist.barrier()
        p = os.path.join("/dev/shm", name)
        if os.path.exists(p):
            os.unlink(p)
        tag = _shmckpt.replica_tag(self.root)
        for rep in list_replicas():
            if rep["root_tag"] == tag and rep["source_rank"] == self.r.partner:
                remove_replica(rep["name"])


def shmckpt_round(r: Rank, shm: Shm, state: Dict[str, Any], dig: Dict[int, Dict[str, str]]) -> None:
    shm.step += 1
    r.sync()
    t0 = time.perf_counter()
    h = shm.ck.save(shm.step, state, blocking=False)
    rep = h.wait_replicated()
    dt = time.perf_counter() - t0
    assert rep["k_safe"], rep
    r.put("shmckpt", "save_to_k_safe_s", r.slowest(dt))
    shm.lose_machine_1()
    r.sync()
    t0 = time.perf_counter()
    got = shm.ck.load(shm.step, map_location=None if r.dev == "cpu" else r.dev)
    if r.dev != "cpu":
        r.torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    src = shm.ck.last_load_source
    want = ("peer", r.partner) if r.lost else ("memory", None)
    r.put("shmckpt", "peer_restore_s", r.slowest(dt if r.lost else None))
    r.agree_exact("shmckpt", tuple(src or ()) == want and digests(got) == dig[r.me])
    del got


# ---- (a) NVRx local checkpointing ----------------------------------------------------


def nvrx_check(device: str, ngpu: int, backend: Optional[str]) -> Optional[str]:
    """Why NVRx cannot run here, or None."""
    try:
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager  # noqa: F401
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the skip's reason
        return f"nvidia-resiliency-ext is not importable ({type(e).__name__}: {e})"
    if device != "cuda":
        return ("needs CUDA: BasicTensorAwareStateDict asserts every tensor is on CUDA and the "
                "retrieval sends through .cuda() (run with --device cuda)")
    if backend is None and ngpu < WORLD:
        return (f"its retrieval sends CUDA tensors point to point (GroupWrapper.isend_state_dict): that needs an "
                f"NCCL group with one GPU per rank, and this box has {ngpu} GPU(s) for {WORLD} ranks (gloo's "
                "send would hand a device pointer to its TCP transport); run on 4 GPUs, or force --nvrx-backend")
    return None


class Nvrx:
    """NVRx's manager of this rank and its clique's group ({r, r+2})."""

    def __init__(self, r: Rank, root: str, backend: str) -> None:
        from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper

        self.r, self.root = r, root
        groups = [r.dist.new_group([i, i + HALF], backend=backend, timeout=datetime.timedelta(seconds=r.a.timeout))
                  for i in range(HALF)]
        self.wrapper = GroupWrapper.from_list_of_groups(groups)
        self.iteration = 0
        self.mgr = self.open()

    def open(self) -> Any:
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

        strat = CliqueReplicationStrategy(self.wrapper, target_device="cpu")
        return LocalCheckpointManager(os.path.join(self.root, f"m{self.r.me // HALF}"), "peers", strat)


def nvrx_round(r: Rank, nv: Nvrx, state: Dict[str, Any], dig: Dict[int, Dict[str, str]]) -> None:
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

    nv.iteration += 1
    sd = BasicTensorAwareStateDict(dict(state))  # it empties and refills the dict it is given
    r.sync()
    t0 = time.perf_counter()
    nv.mgr.save(sd, nv.iteration, is_async=False)
    dt = time.perf_counter() - t0
    r.put("nvrx", "save_to_replicated_s", r.slowest(dt))
    del sd
    r.dist.barrier()
    if r.lost:  # machine m1 and its local checkpoint directory are gone
        shutil.rmtree(os.path.join(nv.root, "m1"), ignore_errors=True)
    r.dist.barrier()
    nv.mgr = nv.open()  # the restart
    r.sync()
    t0 = time.perf_counter()
    it = nv.mgr.find_latest()
    got, _ = nv.mgr.load()
    r.torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    r.put("nvrx", "peer_restore_s", r.slowest(dt if r.lost else None))
    r.agree_exact("nvrx", it == nv.iteration and digests(got.state_dict) == dig[r.me])
    del got


# ---- the rank --------------------------------------------------------------------------


def rank_main(a: argparse.Namespace) -> None:
    r = Rank(a)
    nbytes = a.size
    state, dig = load_state(r, nbytes)
    image = sum(v.numel() * v.element_size() for v in state.values())
    skips: Dict[str, str] = {}
    for name in a.systems:
        why = None
        if name == "torchft":
            why = torchft_check()
        elif name == "nvrx":
            ngpu = r.torch.cuda.device_count() if a.device == "cuda" else 0
            why = nvrx_check(a.device, ngpu, a.nvrx_backend)
        elif name == "shmckpt":
            try:
                import shmckpt  # noqa: F401
            except Exception as e:  # noqa: BLE001 - any import failure is the skip's reason
                why = f"shmckpt is not importable ({type(e).__name__}: {e})"
        whys = r.gather(why)
        if any(whys):
            skips[name] = next(w for w in whys if w)
    run = [s for s in a.systems if s not in skips]
    shm = Shm(r, os.path.join(a.work, "shmckpt"), image) if "shmckpt" in run else None
    nv = None
    if "nvrx" in run:
        nv = Nvrx(r, os.path.join(a.work, "nvrx"), a.nvrx_backend or "nccl")
    step = 0
    for rnd in range(a.rounds + 1):  # round 0 warms up (arenas, files, connections)
        k = rnd % len(run)
        for name in run[k:] + run[:k]:
            step += 1
            if name == "transport":
                transport_round(r, state, dig)
            elif name == "torchft":
                torchft_round(r, state, dig, step)
            elif name == "shmckpt":
                assert shm is not None
                shmckpt_round(r, shm, state, dig)
            elif name == "nvrx":
                assert nv is not None
                nvrx_round(r, nv, state, dig)
        if rnd == 0:
            r.samples.clear()
    left: Dict[str, Any] = {}  # what shmckpt put in /dev/shm, all removed by close
    if shm is not None:
        from shmckpt import _shmckpt

        left = {"kept": r.gather(shm.ck.shm_name), "replica_tag": _shmckpt.replica_tag(shm.root)}
        shm.close()
    r.dist.barrier()
    if r.me == 0:
        with open(a.result, "w") as f:
            json.dump({"image_bytes": image, "samples": r.samples, "exact": r.exact, "skips": skips,
                       "order": run, "shmckpt_shm": left}, f)
    r.dist.destroy_process_group()


# ---- the launcher ----------------------------------------------------------------------


def med(xs: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(res: Dict[str, Any]) -> Dict[str, Any]:
    """Medians (min-max) of every measure, and per round limit / measure."""
    s = res["samples"]
    lim = s.get("transport", {})
    out: Dict[str, Any] = {}
    for system, keys in MEASURES.items():
        if system not in s:
            continue
        for key, against in keys:
            xs = s[system][key]
            row: Dict[str, Any] = {"seconds": med(xs),
                                   "gib_per_s": med([res["image_bytes"] / x / (1 << 30) for x in xs])}
            if against in lim:
                row["x_transport_" + against.removesuffix("_s")] = med([d / n for n, d in zip(xs, lim[against])])
            out[f"{system}.{key}"] = row
    return out


def fmt(m: Dict[str, float], nd: int = 3) -> str:
    return f"{m['median']:.{nd}f} ({m['min']:.{nd}f}-{m['max']:.{nd}f})"


def markdown(runs: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    lines = [f"# Peer checkpoints side by side ({meta['utc']})", "",
             f"`{meta['command']}`; 4 ranks, 2 simulated machines, gloo on 127.0.0.1, device {meta['device']}; "
             f"{meta['rounds']} alternated rounds, medians (min-max); x limit = the transport's seconds / the "
             "system's, per round (1: at the limit).", ""]
    for run in runs:
        n = run["image_bytes"]
        lines += [f"## {n / (1 << 20):.0f} MiB per rank", ""]
        for name, why in run["skips"].items():
            lines.append(f"SKIP {name}: {why}")
        lines += ["", "| system: measure | seconds | GiB/s per rank | x limit | exact |", "|---|---|---|---|---|"]
        for key, row in run["summary"].items():
            system = key.split(".")[0]
            x = next((v for k, v in row.items() if k.startswith("x_transport_")), None)
            lim = next((k.removeprefix("x_transport_") for k in row if k.startswith("x_transport_")), "")
            lines.append(f"| {key} | {fmt(row['seconds'])} | {fmt(row['gib_per_s'], 2)} | "
                         f"{fmt(x, 2) + ' vs ' + lim if x else ''} | {run['exact'].get(system)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def remove_shm_of(root: str) -> None:
    """Remove shmckpt's kept arenas and replicas of ``root`` from /dev/shm (exact names; a
    failed run leaves them, a finished one removed them already)."""
    if not os.path.isdir(root):
        return
    try:
        from shmckpt import _shmckpt
        from shmckpt.replicas import list_replicas, remove_replica
    except ImportError:
        return
    tag = _shmckpt.replica_tag(root)
    for q in range(WORLD):
        p = os.path.join("/dev/shm", f"shmckpt.keep-{tag}.r{q}")
        if os.path.lexists(p):
            os.unlink(p)
    for rep in list_replicas():
        if rep["root_tag"] == tag:
            remove_replica(rep["name"])


def launch(a: argparse.Namespace, size: int, work: str) -> Dict[str, Any]:
    result = os.path.join(work, "result.json")
    port = free_port()
    base = [sys.executable, os.path.abspath(__file__), "--role", "rank", "--size-bytes", str(size),
            "--rounds", str(a.rounds), "--device", a.device, "--work", work, "--result", result,
            "--port", str(port), "--timeout", str(a.timeout), "--systems", ",".join(a.systems)]
    if a.nvrx_backend:
        base += ["--nvrx-backend", a.nvrx_backend]
    procs = [subprocess.Popen(base + ["--rank", str(q)]) for q in range(WORLD)]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"a rank failed at {size} bytes per rank: exit codes {codes}")
    with open(result) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1GiB,4GiB", help="state bytes per rank, comma separated (64MiB, 1GiB, ...)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per size (plus one warm-up)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where each rank's state lives")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which systems to run")
    p.add_argument("--nvrx-backend", default=None, help="NVRx clique groups' backend (default nccl, with a GPU per rank; else NVRx is skipped)")
    p.add_argument("--nvrx-dir", default="/dev/shm", help="where the NVRx machine directories go (a new directory in it)")
    p.add_argument("--root", default=None, help="where shmckpt's root goes (local disk; a new directory in it)")
    p.add_argument("--timeout", type=int, default=600, help="seconds any collective waits")
    p.add_argument("--out", required=False, default=None, help="directory for peers.json and peers.md")
    p.add_argument("--role", default="launch", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--size-bytes", dest="size", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--work", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.systems = [s for s in a.systems.split(",") if s]
    bad = [s for s in a.systems if s not in SYSTEMS]
    if bad:
        p.error(f"unknown systems {bad}; known: {SYSTEMS}")
    if a.role == "rank":
        rank_main(a)
        return
    if not a.out:
        p.error("--out is required")
    os.makedirs(a.out, exist_ok=True)
    runs = []
    for size in [parse_size(s) for s in a.sizes.split(",") if s]:
        work = tempfile.mkdtemp(prefix="peers-bench-", dir=a.root)
        nvdir = tempfile.mkdtemp(prefix="peers-bench-nvrx-", dir=a.nvrx_dir)
        os.symlink(nvdir, os.path.join(work, "nvrx"))
        try:
            res = launch(a, size, work)
        finally:
            remove_shm_of(os.path.join(work, "shmckpt"))
            shutil.rmtree(nvdir, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
        for name, why in res["skips"].items():
            print(f"SKIP {name}: {why}", flush=True)
        res["size_arg"] = size
        res["summary"] = summarize(res)
        runs.append(res)
    import torch

    meta = {"utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "device": a.device,
            "rounds": a.rounds, "python": sys.version.split()[0], "torch": torch.__version__,
            "torchft": pkg_version("torchft"), "nvidia-resiliency-ext": pkg_version("nvidia-resiliency-ext"),
            "shmckpt": pkg_version("shmckpt"), "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None}
    with open(os.path.join(a.out, "peers.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1)
    md = markdown(runs, meta)
    with open(os.path.join(a.out, "peers.md"), "w") as f:
        f.write(md)
    print(md, flush=True)


if __name__ == "__main__":
    main()
