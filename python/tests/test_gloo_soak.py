"""The multi-rank soak over gloo (issue 38, item 4; docs/crash.md section 6): a 2-rank job
of ``Checkpointer``s with peer replicas over torch.distributed (``replicas=1``, each rank
on a simulated machine of its own) and a disk cadence (``disk_every=2``), killed again and
again: at a random time, in the middle of a replica transfer (a rank killed at an
``isend``), or with a machine loss (rank 1's machine: its staging arena, the replicas it
held and its files of every committed step).

Each machine is a mount namespace with a /dev/shm of its own (a holder process, as the
failure drill ``examples/replica_drill.py`` makes them; each rank's process, forked from
the test's server, joins its machine's namespace first): a machine loss kills the holder,
so everything in that /dev/shm goes, whatever its name, and the machine comes back with
an empty one. Where mount namespaces cannot be made (not root, no ``unshare``) the machine
loss removes the segments it knows of from the shared /dev/shm instead, and the summary
says so; ``SHMCKPT_REQUIRE_NS=1`` (CI) makes that a failure. Every incarnation's ``load("latest")`` (the
collective: recovery, completion of a memory-only step from a partner's replica, restore
of lost files) is compared bit for bit with the state saved of that step, and must be at
least:

- after a process kill, the newest step whose ``wait()`` returned on both ranks (disk or
  memory-only: recovery commits what was staged);
- after a machine loss, the newest disk step both ranks reported replicated (k-safe), and
  the newest memory-only step both reported replicated when no newer step was committed
  at the kill (a newer committed step supersedes it: it gives the memory-only step up).

At the end one more incarnation saves two steps and closes; its resume is checked too,
then the replicas are removed and none, nor any receiver's temporary file, may be left.
``SHMCKPT_GLOO_SOAK_FAULTS`` sets the number of faults (default 40),
``SHMCKPT_GLOO_SOAK_SEED`` replays a run's choices (not the kills' timing).
"""

import json
import os
import pathlib
import random
import sys
import time

import pytest

from shmckpt import _shmckpt
from shmckpt.replicas import list_replicas, remove_replica

import zygote
from conftest import REPO, free_port
from replica_support import namespaces_missing, remove_replicas_of

WORKER = str(pathlib.Path(__file__).with_name("gloo_soak_worker.py"))
WORLD = 2
#: Seconds an incarnation may take to resume before the job counts as hung.
HANG = 120.0


class Machines:
    """Each rank's machine: a mount namespace with its own /dev/shm (``Machine`` of
    ``examples/replica_drill.py``, one implementation), or ``None`` where none can be made
    (then the machines share the host's /dev/shm)."""

    SHM_MIB = 256

    def __init__(self):
        sys.path.insert(0, str(REPO / "examples"))
        try:
            from replica_drill import Machine
        finally:
            sys.path.remove(str(REPO / "examples"))
        self.make = lambda: Machine(self.SHM_MIB)
        self.held = [self.make() for _ in range(WORLD)]

    def ns_path(self, r):
        """Machine ``r``'s mount namespace (its holder's)."""
        return f"/proc/{self.held[r].proc.pid}/ns/mnt"

    def namespace(self, r):
        """Machine ``r``'s mount namespace, as ``readlink /proc/PID/ns/mnt`` names it."""
        return os.readlink(self.ns_path(r))

    def env(self, r):
        """What makes rank ``r``'s process join its machine (gloo_soak_worker.py)."""
        return {"GLOO_SOAK_MNT_NS": self.ns_path(r)}

    def lose(self, r):
        """Machine ``r`` is gone (its holder killed: its /dev/shm with it) and replaced by
        a fresh one with an empty /dev/shm."""
        self.held[r].kill()
        self.held[r] = self.make()
        assert self.held[r].shm() == [], "a fresh machine's /dev/shm is not empty"

    def clean(self, r, root):
        """Remove ``root``'s replicas held on machine ``r`` (``shmckpt.replicas``, inside
        its namespace) and return the names left in its /dev/shm."""
        env = dict(os.environ, **self.env(r))
        p = zygote.run([sys.executable, WORKER, "--clean", str(root)], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
        return json.loads(p.stdout.splitlines()[-1])

    def close(self):
        for m in self.held:
            m.kill()


def read_log(path):
    """The JSON lines of a rank's log (a kill leaves whole lines)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def committed_steps(root):
    return sorted(
        int(p.name[5:])
        for p in root.iterdir()
        if p.name.startswith("step-") and p.name[5:].isdigit() and (p / "manifest.json").is_file()
    )


class Job:
    """One incarnation: both ranks started, their logs read back."""

    def __init__(self, root, logdir, n, die_rank=None, die_at=0, steps=None, hold=False, machines=None):
        self.logs = [logdir / f"inc{n}-rank{r}.jsonl" for r in range(WORLD)]
        self.kill_t = None
        # The mount namespace each rank must run in: its machine's, or the test's own.
        self.namespaces = [
            machines.namespace(r) if machines is not None else os.readlink("/proc/self/ns/mnt") for r in range(WORLD)
        ]
        port = str(free_port())
        self.procs = []
        for r in range(WORLD):
            env = dict(os.environ)
            if machines is not None:
                env.update(machines.env(r))
            if r == die_rank:
                env["GLOO_SOAK_DIE_AT"] = str(die_at)
            if hold:
                env["GLOO_SOAK_HOLD_MEMORY"] = "1"
            args = [sys.executable, WORKER, str(root), str(r), str(WORLD), port, str(self.logs[r])]
            if steps is not None:
                args.append(str(steps))
            self.procs.append(zygote.spawn(args, env=env))

    def events(self, r, kind):
        return [ev for ev in read_log(self.logs[r]) if ev["e"] == kind]

    def wait_resumed(self):
        """Both ranks' ``resumed`` events; ``None`` when a rank killed itself first (its
        isend came in the load's transfers)."""
        t0 = time.monotonic()
        while not all(self.events(r, "resumed") for r in range(WORLD)):
            if any(self.events(r, "dying") for r in range(WORLD)):
                return None
            dead = [p.poll() for p in self.procs]
            if any(c is not None for c in dead):
                raise AssertionError(f"a rank ended before resuming: exit codes {dead}, logs {self.tails()}")
            if time.monotonic() - t0 > HANG:
                raise AssertionError(f"the job did not resume in {HANG} s: logs {self.tails()}")
            time.sleep(0.02)
        for r in range(WORLD):
            got = self.events(r, "opened")[0]["mnt_ns"]
            assert got == self.namespaces[r], f"rank {r} runs in mount namespace {got}, not its machine's {self.namespaces[r]}"
        return [self.events(r, "resumed")[0] for r in range(WORLD)]

    def kill(self):
        if self.kill_t is None:
            self.kill_t = time.monotonic()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        return [p.wait(timeout=60) for p in self.procs]

    def errors_before_a_death(self):
        """Errors a rank reported before any rank of the job died (by its own kill or the
        parent's): nothing may fail while both ranks live."""
        deaths = [ev["t"] for r in range(WORLD) for ev in self.events(r, "dying")]
        first = min([*deaths, self.kill_t if self.kill_t is not None else float("inf")])
        return [ev for r in range(WORLD) for ev in self.events(r, "error") if ev["t"] < first]

    def tails(self):
        return [read_log(lg)[-3:] for lg in self.logs]


def newest_on_both(job, kind, pred=lambda ev: True):
    per_rank = [{ev["step"] for ev in job.events(r, kind) if pred(ev)} for r in range(WORLD)]
    both = set.intersection(*per_rank)
    return max(both) if both else None


def lose_machine_1(root, shm_name):
    """Rank 1's machine is gone, where the machines share /dev/shm: its staging arena, the
    replicas it held (rank 0's images, with their entries and any being received) and its
    files of every committed step."""
    p = pathlib.Path("/dev/shm") / shm_name
    if p.is_file() and not p.is_symlink():
        p.unlink()
    tag = _shmckpt.replica_tag(str(root))
    for rep in list_replicas():
        if rep["root_tag"] == tag and rep["source_rank"] == 0:
            remove_replica(rep["name"])
    for q in pathlib.Path("/dev/shm").glob(f"shmckpt-replica.{tag}.r0.*"):
        if q.is_file() and not q.is_symlink():
            q.unlink()
    return lose_files_of_rank_1(root)


def lose_files_of_rank_1(root):
    """Rank 1's files of every committed step (its machine's disk) are gone; how many."""
    lost = 0
    for s in committed_steps(root):
        m = json.loads((root / f"step-{s}" / "manifest.json").read_text())
        for f in m["files"]:
            if f["rank"] == 1 and (root / f"step-{s}" / f["file"]).exists():
                (root / f"step-{s}" / f["file"]).unlink()
                lost += 1
    return lost


def test_two_gloo_ranks_with_replicas_survive_kills_and_machine_losses(tmp_path, capsys):
    why_not = namespaces_missing()
    if why_not is not None and os.environ.get("SHMCKPT_REQUIRE_NS") == "1":
        pytest.fail(f"SHMCKPT_REQUIRE_NS=1 but {why_not}: the machines cannot have their own /dev/shm")
    machines = Machines() if why_not is None else None
    try:
        soak(tmp_path, capsys, machines, why_not)
    finally:
        if machines is not None:
            machines.close()


def soak(tmp_path, capsys, machines, why_not):
    faults = int(os.environ.get("SHMCKPT_GLOO_SOAK_FAULTS", "40"))
    seed = int(os.environ.get("SHMCKPT_GLOO_SOAK_SEED", str(random.SystemRandom().randrange(1 << 32))))
    rng = random.Random(seed)
    root = tmp_path / "root"
    root.mkdir()
    logdir = tmp_path / "logs"
    logdir.mkdir()
    prev_tails = None
    counts = {"kill at a random time": 0, "kill mid-transfer (isend)": 0, "machine loss with its files": 0}
    resumes = {"disk": 0, "memory": 0, "peer": 0, "fresh": 0}
    need = None  # the step the next incarnation must resume at or after
    disk_safe = None  # the newest disk step both ranks reported replicated (k-safe)
    mem_safe = None  # the same for memory-only steps
    files_lost = 0
    held = 0  # machine losses right after a replicated memory-only step
    load_kills = 0  # mid-transfer kills that came in the load's transfers (restores)
    shm_names = set()
    t_start = time.monotonic()
    try:
        for n in range(faults):
            x = rng.random()
            cls = "kill at a random time" if x < 0.5 else "kill mid-transfer (isend)" if x < 0.75 else "machine loss with its files"
            die_rank = rng.randrange(WORLD) if cls == "kill mid-transfer (isend)" else None
            # Half of the machine losses come right after a memory-only step was
            # replicated on both ranks (the ranks hold there): its completion from the
            # partner's replica is then what the resume needs.
            hold = cls == "machine loss with its files" and rng.random() < 0.5
            job = Job(root, logdir, n, die_rank=die_rank, die_at=rng.randrange(2, 9), hold=hold, machines=machines)
            try:
                resumed = job.wait_resumed()
                in_load = resumed is None
                if in_load:  # killed in the load's transfers: no resume to check
                    resumed = [{"step": need}] * WORLD
                    cls = "kill mid-transfer (isend)"
                    load_kills += 1
                for r, ev in enumerate([] if in_load else resumed):
                    where = f"seed {seed}, incarnation {n}, rank {r}"
                    assert ev["exact"], f"{where}: the resume of step {ev['step']} is not exact"
                    assert need is None or (ev["step"] is not None and ev["step"] >= need), (
                        f"{where}: resumed at {ev['step']}, must be >= {need}; previous logs {prev_tails}"
                    )
                    src = ev["source"][0] if ev["source"] else "fresh"
                    resumes[src] = resumes.get(src, 0) + 1
                at = resumed[0]["step"]
                assert resumed[1]["step"] == at, f"seed {seed}: the ranks resumed at {resumed}"
                # Steps beyond the resume are gone (set aside, or never committed).
                if not in_load and mem_safe is not None and (at is None or mem_safe > at):
                    mem_safe = None
                shm_names.update(ev["shm"] for r in range(WORLD) for ev in job.events(r, "opened"))
                if cls == "kill mid-transfer (isend)":
                    t0 = time.monotonic()
                    while job.procs[die_rank].poll() is None and time.monotonic() - t0 < 30:
                        time.sleep(0.01)
                    if not job.events(die_rank, "dying"):
                        cls = "kill at a random time"  # its isend never came
                elif hold:
                    t0 = time.monotonic()
                    while not all(job.events(r, "holding") for r in range(WORLD)):
                        assert time.monotonic() - t0 < HANG, f"seed {seed}: the ranks never held: {job.tails()}"
                        time.sleep(0.01)
                    held += 1
                else:
                    time.sleep(rng.uniform(0.0, 1.5))
                codes = job.kill()
            finally:
                job.kill()
            assert all(c == -9 for c in codes), f"seed {seed}, incarnation {n}: exit codes {codes}, logs {job.tails()}"
            early = job.errors_before_a_death()
            assert early == [], f"seed {seed}, incarnation {n}: errors while both ranks lived: {early}"
            prev_tails = job.tails()
            counts[cls] += 1
            for v, pred in (
                ("disk", lambda ev: ev["k_safe"] and not ev["memory_only"]),
                ("mem", lambda ev: ev["k_safe"] and ev["memory_only"]),
            ):
                s_ = newest_on_both(job, "replicated", pred)
                if s_ is not None and v == "disk":
                    disk_safe = max(disk_safe or 0, s_)
                if s_ is not None and v == "mem":
                    mem_safe = max(mem_safe or 0, s_)
            if cls != "machine loss with its files":
                # A process kill: what both ranks staged is recovered at the next open.
                floor = [x for x in (need, at, newest_on_both(job, "saved")) if x is not None]
                need = max(floor) if floor else None
                continue
            newest_committed = max(committed_steps(root), default=None)
            if machines is not None:
                machines.lose(1)
                files_lost += lose_files_of_rank_1(root)
            else:
                opened = job.events(1, "opened")
                files_lost += lose_machine_1(root, opened[0]["shm"]) if opened else 0
            # What survives the loss: the replicated steps; a memory-only one only while
            # no newer step was committed (that gives it up).
            floor = [disk_safe] if disk_safe is not None else []
            if mem_safe is not None and (newest_committed is None or newest_committed <= mem_safe):
                floor.append(mem_safe)
            need = max(floor) if floor else None
        # The end: one more incarnation saves two steps and closes.
        job = Job(root, logdir, faults, steps=2, machines=machines)
        try:
            resumed = job.wait_resumed()
            codes = [p.wait(timeout=HANG) for p in job.procs]
        finally:
            job.kill()
        assert codes == [0, 0], f"seed {seed}: the last incarnation exited {codes}: {job.tails()}"
        assert all(not job.events(r, "error") for r in range(WORLD)), f"seed {seed}: {job.tails()}"
        for r, ev in enumerate(resumed):
            assert ev["exact"] and (need is None or ev["step"] >= need), f"seed {seed}, last incarnation, rank {r}: {ev}"
        shm_names.update(ev["shm"] for r in range(WORLD) for ev in job.events(r, "opened"))
    except BaseException:
        # A failed run leaks nothing either: its dead ranks' staging arenas go too (with
        # the machines' namespaces, when their holders are killed).
        if machines is None:
            for name in shm_names:
                p = pathlib.Path("/dev/shm") / name
                if p.is_file() and not p.is_symlink():
                    p.unlink()
            remove_replicas_of(root)
        raise
    wall = time.monotonic() - t_start
    tag = _shmckpt.replica_tag(str(root))
    if machines is not None:
        # Each machine's /dev/shm once its replicas of the root are removed.
        shm_left = {n for r in range(WORLD) for n in machines.clean(r, root)}
    else:
        remove_replicas_of(root)
        shm_left = set(os.listdir("/dev/shm"))
    left = sorted(n for n in shm_left if n.startswith(f"shmckpt-replica.{tag}."))
    assert left == [], f"seed {seed}: replicas or temporary files left: {left}"
    arenas = sorted(shm_names & shm_left)
    assert arenas == [], f"seed {seed}: staging arenas left: {arenas}"
    with capsys.disabled():
        print(
            f"\ngloo soak: seed {seed} (SHMCKPT_GLOO_SOAK_SEED replays its choices), {sum(counts.values())} faults in {wall:.1f} s: "
            f"{counts} ({load_kills} of the mid-transfer kills in the load's transfers, {held} machine losses right "
            f"after a replicated memory-only step); resumes by source {resumes}; "
            f"{files_lost} rank files lost with machine 1; "
            + ("machines: mount namespaces, each with its own /dev/shm" if machines is not None else f"machines share /dev/shm ({why_not})")
        )
