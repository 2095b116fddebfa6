"""The failure drill of peer replicas (docs/replicas.md, issue 25): a machine is lost with
its memory and its files, and its ranks' checkpoint comes back from the other machine's
memory, bit for bit. Runs on one host, as root:

    PYTHONPATH=python python examples/replica_drill.py                # a shared root
    PYTHONPATH=python python examples/replica_drill.py --node-local   # a root per machine
    PYTHONPATH=python python examples/replica_drill.py --device cuda --mib 1024 --steps 3

4 ranks over gloo (``torch.distributed``, started as torchrun starts them: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE=2``, ``MASTER_ADDR``/``PORT``) simulate
2 machines of 2 ranks. Each machine has its own ``/dev/shm``: a mount namespace holding a
tmpfs on ``/dev/shm`` (``unshare --mount``), kept alive by a holder process between the
phases; its ranks join it with ``nsenter``. The root is shared by default; with
``--node-local`` each machine has its own (``Replicas(node_local_root=True)``).

1. Every rank builds ``Checkpointer(root, keep_in_memory=True, replicas=1)`` and saves
   ``--steps`` steps of a deterministic state (seeded tensors of several dtypes, ``--mib``
   per rank, on ``--device``), ``wait_replicated()`` after each; the reports are printed.
2. Machine 1 is lost: its namespace is killed (its ``/dev/shm`` is gone) and its ranks'
   files are removed (with ``--node-local``, its whole root); a fresh machine (a new,
   empty namespace, no root) replaces it.
3. All 4 ranks restart and ``load("latest")`` (to ``--device``; ``--load-cpu``: to the
   CPU); each compares every tensor with the regenerated state (dtype, shape,
   ``torch.equal`` and the exact bytes). Ranks 0-1 must load from their own memory
   (``("memory", None)``), ranks 2-3 from their partners' replicas (``("peer", 0)``,
   ``("peer", 1)``), and their files are written back.

Exit status 0 only when all of that holds (1 otherwise, with the reasons; 2 when the drill
cannot run: not root, no ``unshare``/``nsenter``, a ``--root`` that is not empty). The last
line printed is one JSON object with everything the drill saw (``ok``, ``problems``, the
reports, each machine's ``/dev/shm`` after the saves, the roots, the loads). Everything it
made is removed at the end (namespaces, rank processes, its temporary directory; a
``--root`` given is left for inspection).

``--shared-shm`` runs the drill without namespaces (no root needed), where ``unshare`` is
not permitted (a container): the machines then share the host's ``/dev/shm``, and losing
machine 1 removes, by exact name, its ranks' kept arenas and the replicas it held.
"""

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

WORLD = 4  #: ranks
LOCAL = 2  #: ranks per machine (LOCAL_WORLD_SIZE)
MACHINES = WORLD // LOCAL
LOST = 1  #: the machine that is lost
MiB = 1 << 20


class DrillError(Exception):
    """The drill cannot run here (exit status 2)."""


# -- the state ---------------------------------------------------------------------------
#: (name, dtype, share of the bytes)
LAYOUT = [
    ("w_f32", torch.float32, 0.5),
    ("m_bf16", torch.bfloat16, 0.15),
    ("v_f16", torch.float16, 0.1),
    ("idx_i64", torch.int64, 0.1),
    ("pos_i32", torch.int32, 0.1),
    ("mask_u8", torch.uint8, 0.05),
]


def layout(mib: float) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
    """The state's tensors for about ``mib`` MiB: (name, dtype, shape)."""
    total = int(mib * MiB)
    out: List[Tuple[str, torch.dtype, Tuple[int, ...]]] = []
    for name, dtype, share in LAYOUT:
        n = max(64, int(total * share) // torch.empty((), dtype=dtype).element_size())
        out.append((name, dtype, (n // 64, 64) if n % 64 == 0 else (n,)))
    return out


def rank_state(rank: int, step: int, mib: float, device: torch.device) -> Dict[str, Any]:
    """Rank ``rank``'s state of ``step``: about ``mib`` MiB of seeded tensors on ``device``,
    a function of (rank, step, mib, device) only, and two plain values."""
    g = torch.Generator(device=device).manual_seed(1_000_003 * step + 7919 * rank + 17)
    tensors: Dict[str, torch.Tensor] = {}
    for name, dtype, shape in layout(mib):
        n = 1
        for d in shape:
            n *= d
        if dtype.is_floating_point:
            t = torch.randn(n, generator=g, device=device).to(dtype)
        elif dtype == torch.uint8:
            t = torch.randint(0, 256, (n,), generator=g, device=device, dtype=dtype)
        else:
            hi = 2**40 if dtype == torch.int64 else 2**30
            t = torch.randint(-hi, hi, (n,), generator=g, device=device, dtype=dtype)
        tensors[name] = t.reshape(shape)
    return {"tensors": tensors, "step": step, "rank": rank}


def state_bytes(mib: float) -> int:
    """Bytes of the state's tensors."""
    total = 0
    for _, dtype, shape in layout(mib):
        n = torch.empty((), dtype=dtype).element_size()
        for d in shape:
            n *= d
        total += n
    return total


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, as uint8."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def compare(got: Any, want: Dict[str, Any]) -> List[str]:
    """What differs between a loaded state and the expected one (empty: bit-exact)."""
    if not isinstance(got, dict) or set(got) != set(want):
        return [f"the loaded state's keys {sorted(got) if isinstance(got, dict) else type(got)} are not {sorted(want)}"]
    problems = [f"{k}: {got[k]!r} != {want[k]!r}" for k in ("step", "rank") if got[k] != want[k]]
    tg, tw = got["tensors"], want["tensors"]
    if set(tg) != set(tw):
        return problems + [f"tensors {sorted(tg)} are not {sorted(tw)}"]
    for name, b in tw.items():
        a = tg[name]
        if not isinstance(a, torch.Tensor):
            problems.append(f"{name}: a {type(a).__name__}, not a tensor")
        elif a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{name}: {a.dtype} {tuple(a.shape)}, saved {b.dtype} {tuple(b.shape)}")
        else:
            b = b.to(a.device)
            if not torch.equal(a, b) or not torch.equal(raw(a), raw(b)):
                problems.append(f"{name}: the values differ")
    return problems


# -- one rank (a child process) ----------------------------------------------------------
def rank_main(a: argparse.Namespace) -> None:
    """One rank of a phase (``--role save|load``); writes its JSON result to ``--out``."""
    import torch.distributed as dist

    import shmckpt

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    dev = torch.device("cpu")
    if a.device == "cuda":
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    nbytes = state_bytes(a.mib)
    staging = max(8 * MiB, -(-(nbytes + nbytes // 64 + MiB) // (8 * MiB)) * 8 * MiB)
    ck = shmckpt.Checkpointer(
        a.rank_root,
        keep_in_memory=True,
        replicas=shmckpt.Replicas(k=1, node_local_root=a.node_local, timeout=a.timeout),
        tuning=shmckpt.Tuning(staging_capacity=staging, chunk_size=MiB if staging < 64 * MiB else None),
    )
    res: Dict[str, Any] = {"rank": rank, "shm_name": ck.shm_name, "state_bytes": nbytes}
    if a.role == "save":
        res["reports"] = []
        for step in range(1, a.steps + 1):
            state = rank_state(rank, step, a.mib, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.monotonic()
            h = ck.save(step, state, blocking=False)
            call = time.monotonic() - t0
            try:
                rep = h.wait_replicated()
            except shmckpt.ReplicationError as e:
                res["error"] = f"step {step}: ReplicationError: {e}"
                break
            keys = ("step", "k_safe", "seconds", "phases", "bytes_sent", "sent_from", "transfer_seconds", "problems")
            out = {k: rep[k] for k in keys}
            out["holders"] = {str(k): v for k, v in rep["holders"].items()}
            out["save_call_seconds"] = call
            res["reports"].append(out)
    else:
        t0 = time.monotonic()
        try:
            state = ck.load("latest", map_location=dev if dev.type == "cuda" and not a.load_cpu else None)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            res["load_seconds"] = time.monotonic() - t0
            latest = ck.latest()
            res["step"] = latest
            src = ck.last_load_source
            res["source"] = None if src is None else [src[0], src[1]]
            res["problems"] = compare(state, rank_state(rank, latest or 0, a.mib, dev))
            res["exact"] = not res["problems"]
        except shmckpt.ShmckptError as e:
            res["error"] = f"{type(e).__name__}: {e}"
    ck.close()
    if "error" not in res or a.role == "load":  # a failed replication broke the group
        dist.barrier()
        dist.destroy_process_group()
    Path(a.out).write_text(json.dumps(res))


# -- the driver ----------------------------------------------------------------------------
def _die_with_parent() -> None:
    """In a child before exec: SIGKILL it when the drill dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class Machine:
    """A simulated machine: a holder process in a mount namespace with its own tmpfs on
    /dev/shm; its ranks join it with ``nsenter``. Killing the holder frees that /dev/shm."""

    def __init__(self, shm_mib: int):
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs -o size={shm_mib}m tmpfs /dev/shm && echo ready && exec sleep infinity"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.kill()
            err = self.proc.stderr.read().strip() if self.proc.stderr else ""
            raise DrillError(f"the namespace holder did not start: {line!r} {err}")

    def prefix(self) -> List[str]:
        return ["nsenter", "-t", str(self.proc.pid), "-m", f"--wd={os.getcwd()}", "--"]

    def shm(self) -> List[str]:
        out = subprocess.run(self.prefix() + ["ls", "-A", "/dev/shm"], capture_output=True, text=True, check=True)
        return sorted(out.stdout.split())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def preflight(a: argparse.Namespace) -> None:
    """Raise DrillError when the drill cannot run here."""
    if a.device == "cuda" and not torch.cuda.is_available():
        raise DrillError("--device cuda: torch sees no CUDA device")
    if a.shared_shm:
        return
    hint = " (--shared-shm runs the drill in the host's /dev/shm, without namespaces)"
    if os.geteuid() != 0:
        raise DrillError("must run as root: a private /dev/shm per machine is a mount namespace" + hint)
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            raise DrillError(f"`{tool}` is not installed (util-linux)" + hint)
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    if p.returncode != 0:
        raise DrillError(f"`unshare --mount` is not permitted here: {p.stderr.strip()}" + hint)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def entries_digest(files: List[Dict[str, Any]]) -> str:
    """sha256 of a manifest's ``files`` entries (names, sizes, every tensor's CRC-32C)."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def partner(rank: int) -> int:
    """The rank that holds ``rank``'s replica (replicas=1: the ring over machines)."""
    m, i = divmod(rank, LOCAL)
    return ((m + 1) % MACHINES) * LOCAL + i


class Drill:
    """One run of the drill: its machines, its roots, its rank processes, what it saw
    (``report``) and what went wrong (``problems``)."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        given = Path(a.root).resolve() if a.root else None
        if given is not None and given.exists() and (not given.is_dir() or any(given.iterdir())):
            raise DrillError(f"--root {given} is not an empty directory")
        self.work = Path(tempfile.mkdtemp(prefix="shmckpt-drill-"))
        base = given or self.work / "root"
        self.roots = [base / f"m{m}" if a.node_local else base for m in range(MACHINES)]
        self.base = base
        self.machines: List[Optional[Machine]] = [None] * MACHINES
        self.procs: List[subprocess.Popen] = []
        self.shm_names: Dict[int, str] = {}
        self.problems: List[str] = []
        self.report: Dict[str, Any] = {
            "ok": False, "problems": self.problems, "world": WORLD, "local_world_size": LOCAL,
            "mode": "node-local" if a.node_local else "shared", "namespaces": not a.shared_shm,
            "device": a.device, "steps": a.steps, "mib": a.mib, "roots": [str(r) for r in self.roots],
        }

    def say(self, msg: str) -> None:
        print(msg, flush=True)

    def shm_mib(self) -> int:
        """Each machine's tmpfs (MiB): per rank its kept arena and two replicas of its
        partner (a step's replica arrives while the one before is still held)."""
        per_rank = self.a.mib * 1.02 + 9  # the kept arena (rounded up) and its slack
        return self.a.shm_mib or int(LOCAL * (per_rank + 2 * (self.a.mib * 1.02 + 1)) + 64)

    def start_machine(self, m: int) -> None:
        if not self.a.shared_shm:
            self.machines[m] = Machine(self.shm_mib())

    def prefix(self, m: int) -> List[str]:
        mach = self.machines[m]
        return [] if mach is None else mach.prefix()

    def run_ranks(self, role: str) -> List[Dict[str, Any]]:
        """Start the 4 ranks of a phase, each in its machine, and wait for them."""
        port = str(free_port())
        logs = []
        self.procs = []
        for r in range(WORLD):
            m = r // LOCAL
            out, log = self.work / f"{role}-{r}.json", self.work / f"{role}-{r}.log"
            logs.append(log)
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r % LOCAL),
                       LOCAL_WORLD_SIZE=str(LOCAL), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            env.setdefault("OMP_NUM_THREADS", "1")
            cmd = self.prefix(m) + [sys.executable, os.path.abspath(__file__), "--role", role,
                                    "--out", str(out), "--rank-root", str(self.roots[m])] + self.a.forward
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                                   preexec_fn=_die_with_parent))
        deadline = time.monotonic() + self.a.timeout + 60
        for p in self.procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        results = []
        for r, p in enumerate(self.procs):
            if p.poll() is None:
                p.kill()
                p.wait()
                self.problems.append(f"{role}: rank {r} did not finish within {self.a.timeout + 60:.0f} s (killed)")
            out = self.work / f"{role}-{r}.json"
            res = json.loads(out.read_text()) if out.exists() else {"rank": r}
            res["exit_status"] = p.returncode
            if p.returncode != 0 or "error" in res:
                tail = [ln for ln in logs[r].read_text(errors="replace").splitlines() if ln.strip()][-25:]
                why = res.get("error") or f"exit status {p.returncode}: {tail[-1] if tail else '(no output)'}"
                self.problems.append(f"{role}: rank {r} failed: {why}")
                print(f"--- {role} rank {r} output (last lines) ---\n" + "\n".join(tail), file=sys.stderr)
            results.append(res)
        self.procs = []
        return results

    def shm_listing(self) -> Dict[str, List[str]]:
        """Each machine's /dev/shm (with --shared-shm: this drill's names in the host's)."""
        if self.a.shared_shm:
            return {"host": sorted(self.ours_in_host_shm())}
        return {str(m): mach.shm() for m, mach in enumerate(self.machines) if mach is not None}

    def tags(self) -> List[str]:
        from shmckpt import _shmckpt  # the replica names' root tag (one implementation)

        return [_shmckpt.replica_tag(str(r)) for r in self.roots]

    def ours_in_host_shm(self) -> List[str]:
        names = set(self.shm_names.values())
        prefixes = tuple(f"shmckpt-replica.{t}." for t in self.tags())
        return [n for n in os.listdir("/dev/shm") if n in names or n.startswith(prefixes)]

    def roots_listing(self) -> Dict[str, Any]:
        """Per distinct root: each step directory's files, its manifest's step, ranks and
        the digest of its entries (``entries_digest``)."""
        out: Dict[str, Any] = {}
        for root in dict.fromkeys(self.roots):
            steps: Dict[str, Any] = {}
            for d in sorted(root.glob("step-*")) if root.is_dir() else []:
                man = d / "manifest.json"
                m = json.loads(man.read_text()) if man.exists() else {}
                files = m.get("files")
                steps[d.name] = {
                    "files": sorted(p.name for p in d.iterdir()),
                    "manifest_step": m.get("step"),
                    "manifest_ranks": None if files is None else [f["rank"] for f in files],
                    "manifest_sha256": None if files is None else entries_digest(files),
                }
            out[str(root)] = steps
        return out

    def lose_machine(self) -> None:
        """Machine LOST is gone: its /dev/shm and its ranks' files (node-local: its root)."""
        lost = [r for r in range(WORLD) if r // LOCAL == LOST]
        mach = self.machines[LOST]
        removed: List[str] = []
        if mach is not None:
            mach.kill()
        else:  # --shared-shm: its ranks' kept arenas and the replicas it held, by name
            from shmckpt.replicas import list_replicas, remove_replica

            for r in lost:
                p = Path("/dev/shm") / self.shm_names[r]
                if p.is_file() and not p.is_symlink():
                    p.unlink()
                    removed.append(str(p))
            tag = self.tags()[LOST]
            for rep in list_replicas():
                if rep["root_tag"] == tag and partner(rep["source_rank"]) // LOCAL == LOST:
                    remove_replica(rep["name"])
                    removed.append("/dev/shm/" + rep["name"])
        if self.a.node_local:
            shutil.rmtree(self.roots[LOST])
            removed.append(str(self.roots[LOST]))
        else:
            root = self.roots[LOST]
            for s in range(1, self.a.steps + 1):
                man = json.loads((root / f"step-{s}" / "manifest.json").read_text())
                for f in man["files"]:
                    if f["rank"] in lost:
                        (root / f"step-{s}" / f["file"]).unlink()
                        removed.append(str(root / f"step-{s}" / f["file"]))
        self.report["lost"] = {"machine": LOST, "ranks": lost, "removed": removed}
        self.start_machine(LOST)

    def check_saves(self, saved: List[Dict[str, Any]]) -> None:
        want = {str(r): [partner(r)] for r in range(WORLD)}
        for res in saved:
            if res["exit_status"] != 0 or "error" in res:
                continue  # already a problem
            steps = [rep["step"] for rep in res.get("reports", [])]
            if steps != list(range(1, self.a.steps + 1)):
                self.problems.append(f"rank {res['rank']}: replicated steps {steps}")
            for rep in res.get("reports", []):
                if rep["k_safe"] is not True or rep["holders"] != want or rep["problems"]:
                    self.problems.append(f"rank {res['rank']} step {rep['step']}: k_safe {rep['k_safe']}, "
                                         f"holders {rep['holders']} (want {want}), problems {rep['problems']}")

    def check_loads(self, loaded: List[Dict[str, Any]]) -> None:
        latest = self.a.steps
        for res in loaded:
            r = res["rank"]
            want = ["peer", partner(r)] if r // LOCAL == LOST else ["memory", None]
            res["expected_source"] = want
            if "error" in res:
                continue  # already a problem
            if res.get("step") != latest:
                self.problems.append(f"rank {r}: loaded step {res.get('step')}, not the latest ({latest})")
            if res.get("exact") is not True:
                self.problems.append(f"rank {r}: not bit-exact: {'; '.join(res.get('problems', []))}")
            if res.get("source") != want:
                self.problems.append(f"rank {r}: loaded from {res.get('source')}, expected {want}")
        # The lost ranks' files of the latest step are back, of the manifest's size.
        restored = {}
        for r in range(LOCAL * LOST, LOCAL * (LOST + 1)):
            d = self.roots[LOST] / f"step-{latest}"
            man = d / "manifest.json"
            entry = [f for f in json.loads(man.read_text())["files"] if f["rank"] == r] if man.exists() else []
            ok = len(entry) == 1 and (d / entry[0]["file"]).is_file() and (d / entry[0]["file"]).stat().st_size == entry[0]["bytes"]
            restored[str(r)] = ok
            if not ok:
                self.problems.append(f"rank {r}: its file of step {latest} was not written back in {d}")
        self.report["restored_files"] = restored

    def run(self) -> bool:
        a = self.a
        where = f"a root per machine under {self.base}" if a.node_local else f"a shared root {self.base}"
        shm = "the host's /dev/shm (--shared-shm)" if a.shared_shm else f"a private /dev/shm each (tmpfs of {self.shm_mib()} MiB)"
        self.say(f"replica drill: {WORLD} ranks over gloo, {MACHINES} machines of {LOCAL} ranks, {shm}, "
                 f"{where}; {a.steps} steps of {a.mib:g} MiB per rank on {a.device}")
        for m in range(MACHINES):
            self.start_machine(m)

        self.say(f"phase 1: every rank saves steps 1-{a.steps}, wait_replicated() after each")
        saved = self.run_ranks("save")
        self.report["saved"] = saved
        self.shm_names = {res["rank"]: res["shm_name"] for res in saved if "shm_name" in res}
        lines = [(rep["step"], res["rank"], rep) for res in saved for rep in res.get("reports", [])]
        for step, r, rep in sorted(lines, key=lambda x: x[:2]):
            ph = " ".join(f"{k} {v:.3f}" for k, v in rep["phases"].items())
            self.say(f"  step {step} rank {r}: k_safe {rep['k_safe']} in {rep['seconds']:.3f} s "
                     f"(save call {rep['save_call_seconds']:.3f} s; phases: {ph}), "
                     f"held by {rep['holders'][str(r)]}, {rep['bytes_sent']} bytes sent "
                     f"(from staging {rep['sent_from']['staging']}, copied {rep['sent_from']['copied']}, "
                     f"file {rep['sent_from']['file']})")
        self.check_saves(saved)
        self.report["shm_after_save"] = self.shm_listing()
        self.report["roots_after_save"] = self.roots_listing()
        for m, names in self.report["shm_after_save"].items():
            whose = "the host (this drill's names)" if m == "host" else f"machine {m}"
            self.say(f"  /dev/shm of {whose}: {', '.join(names) or '(empty)'}")
        if any(res.get("exit_status") != 0 for res in saved):
            return False

        self.lose_machine()
        lost = self.report["lost"]
        gone = "its namespace killed (its /dev/shm gone)" if not a.shared_shm else \
            "its kept arenas and the replicas it held removed from /dev/shm"
        files = f"its root {self.roots[LOST]} removed" if a.node_local else \
            f"its ranks' files of steps 1-{a.steps} removed"
        self.say(f"machine {LOST} lost (ranks {lost['ranks']}): {gone}, {files}; a fresh machine {LOST} replaces it")
        fresh = self.shm_listing()
        self.report["shm_fresh"] = fresh.get(str(LOST))  # None with --shared-shm
        if not a.shared_shm and fresh[str(LOST)]:
            self.problems.append(f"the fresh machine's /dev/shm is not empty: {fresh[str(LOST)]}")

        self.say(f"phase 2: all {WORLD} ranks restart and load('latest')")
        loaded = self.run_ranks("load")
        self.report["loaded"] = loaded
        self.check_loads(loaded)
        for res in loaded:
            if "error" in res:
                continue
            self.say(f"  rank {res['rank']}: step {res['step']} {'bit-exact' if res['exact'] else 'DIFFERENT'}, "
                     f"from {tuple(res['source'])} in {res['load_seconds']:.3f} s")
        return not self.problems

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for mach in self.machines:
            if mach is not None:
                mach.kill()
        if self.a.shared_shm:
            for n in self.ours_in_host_shm():
                p = Path("/dev/shm") / n
                if p.is_file() and not p.is_symlink() and p.stat().st_uid == os.geteuid():
                    p.unlink()
        shutil.rmtree(self.work, ignore_errors=True)


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--node-local", action="store_true", help="a root per machine (Replicas(node_local_root=True))")
    ap.add_argument("--steps", type=int, default=3, help="steps saved in phase 1 (default 3)")
    ap.add_argument("--mib", type=float, default=16.0, help="MiB of state per rank (default 16)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the state lives and loads to (cuda: every rank on cuda:LOCAL_RANK %% GPUs)")
    ap.add_argument("--load-cpu", action="store_true",
                    help="with --device cuda: load to the CPU (a peer's image served from the received memory)")
    ap.add_argument("--root", help="checkpoint root (an empty or new directory, left afterwards); "
                                   "default: in a temporary directory, removed")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a rank waits for a peer (replica_timeout, the group's timeout; default 300)")
    ap.add_argument("--shm-mib", type=int, help="size of each machine's /dev/shm tmpfs (default: from --mib)")
    ap.add_argument("--shared-shm", action="store_true",
                    help="no namespaces: the machines share the host's /dev/shm (no root needed)")
    ap.add_argument("--role", choices=["save", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--rank-root", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.mib <= 0:
        ap.error("--steps must be at least 1 and --mib positive")
    # What the ranks are given of the drill's options.
    a.forward = ["--steps", str(a.steps), "--mib", repr(a.mib), "--device", a.device, "--timeout", repr(a.timeout)]
    a.forward += ["--node-local"] if a.node_local else []
    a.forward += ["--load-cpu"] if a.load_cpu else []
    return a


def main() -> int:
    a = parse()
    if a.role is not None:
        rank_main(a)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on SIGTERM too
    try:
        preflight(a)
        drill = Drill(a)
    except DrillError as e:
        print(f"replica_drill: {e}", file=sys.stderr)
        return 2
    ok = False
    try:
        ok = drill.run()
    except DrillError as e:
        drill.problems.append(str(e))
    finally:
        drill.cleanup()
    if ok:
        print(f"PASS: every rank loaded step {a.steps} bit-exactly; ranks "
              f"{drill.report['lost']['ranks']} of the lost machine from their partners' replicas", flush=True)
    else:
        print("FAIL:\n  " + "\n  ".join(drill.problems), flush=True)
    drill.report["ok"] = ok
    print(json.dumps(drill.report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
