"""Child process of test_gloo_soak.py (not a test module): one rank of a 2-rank job over
gloo on one host, each rank on a simulated machine of its own (``node="m<rank>"``), with
``replicas=1`` (each rank's images held by the other) and ``Cadence(disk_every=2)``
(every other save memory-only), ``keep_last=3``.

    python gloo_soak_worker.py ROOT RANK WORLD PORT LOG [STEPS]
    python gloo_soak_worker.py --clean ROOT

With ``GLOO_SOAK_MNT_NS=/proc/PID/ns/mnt`` it first joins that mount namespace: its
machine's, with a /dev/shm of its own (the namespace holder of ``test_gloo_soak.py``).
``--clean`` (in a machine's namespace) removes the replicas of ROOT held there, through
``shmckpt.replicas``, and prints the names left in that /dev/shm as one JSON line.

It loads "latest" (a collective: recovery, the completion of a memory-only step from a
partner's replica, restores of lost files), compares it bit for bit with the state saved
of that step, then saves the following steps one after another, each waited for
(``wait()``) and replicated (``wait_replicated()``), until it is killed (or STEPS steps
are saved: then it closes and exits 0). With ``GLOO_SOAK_DIE_AT=N`` it SIGKILLs itself at
its N-th ``isend`` (the middle of a replica transfer over torch.distributed); with
``GLOO_SOAK_HOLD_MEMORY=1`` it stops once a memory-only step is replicated (``holding``),
to be killed there.

Every stage is appended to LOG as one JSON line, in one ``write`` (a kill leaves whole
lines), with its ``time.monotonic()``: ``opened`` (with the staging arena's name and the
mount namespace it runs in),
``resumed`` (step, exact, source), ``saved`` (step), ``replicated`` (step, k_safe,
memory_only), ``holding``, ``dying`` (the self-kill), ``error`` (type, message: then it waits to be
killed, as a rank whose partner died waits for its supervisor).
"""

import json
import os
import sys
import time


def enter_machine():
    """Join the mount namespace ``GLOO_SOAK_MNT_NS`` names, if any: first thing, before
    an import starts a thread (``setns`` refuses a process sharing its filesystem
    attributes with other threads; torch's import may start some) or anything of ours
    opens a segment. The working directory is kept."""
    ns = os.environ.get("GLOO_SOAK_MNT_NS")
    if not ns:
        return
    import ctypes

    cwd = os.getcwd()
    fd = os.open(ns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x00020000) != 0:  # CLONE_NEWNS
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)
    os.chdir(cwd)


enter_machine()

from replica_worker import die_mid_transfer, digest, rank_state  # noqa: E402  (after the setns)


def clean(root):
    """``--clean ROOT``: remove ROOT's replicas held in this machine's /dev/shm and print
    what is left there."""
    from replica_support import remove_replicas_of

    remove_replicas_of(root)
    print(json.dumps(sorted(os.listdir("/dev/shm"))), flush=True)


def main():
    if sys.argv[1] == "--clean":
        clean(sys.argv[2])
        return
    root, rank, world, port, log = sys.argv[1:6]
    steps = int(sys.argv[6]) if len(sys.argv) > 6 else None
    rank, world = int(rank), int(world)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(**ev):
        ev["t"] = time.monotonic()
        os.write(fd, (json.dumps(ev) + "\n").encode())

    die_at = int(os.environ.get("GLOO_SOAK_DIE_AT", "0"))
    import torch.distributed as dist

    import shmckpt

    if die_at:
        die_mid_transfer(die_at, lambda: emit(e="dying", where="isend", n=die_at))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(root, rank, steps, emit, shmckpt, dist)
    except Exception as e:  # noqa: BLE001 - reported; the parent decides whether it may happen
        # A partner died (the soak kills it): its collectives fail here. The job is torn
        # down by the parent, as a supervisor does; the error is judged there.
        emit(e="error", type=type(e).__name__, msg=str(e)[:500])
        while True:
            time.sleep(1)


def run(root, rank, steps, emit, shmckpt, dist):
    ck = shmckpt.Checkpointer(
        root,
        tuning=shmckpt.Tuning(staging_capacity=8 << 20, chunk_size=1 << 20),
        replicas=shmckpt.Replicas(k=1, node=f"m{rank}", timeout=60.0),
        cadence=shmckpt.Cadence(disk_every=2),
        keep_last=3,
    )
    emit(e="opened", shm=ck.shm_name, mnt_ns=os.readlink("/proc/self/ns/mnt"))
    try:
        state = ck.load("latest")
    except shmckpt.NotFound:
        state = None
    if state is None:
        start = 0
        emit(e="resumed", step=None, exact=True, source=None)
    else:
        start = state["step"]
        src = ck.last_load_source
        emit(
            e="resumed",
            step=start,
            exact=digest(state) == digest(rank_state(rank, start)),
            source=None if src is None else [src[0], src[1]],
        )
    step = start
    while steps is None or step < start + steps:
        step += 1
        h = ck.save(step, rank_state(rank, step), blocking=False)
        h.wait()
        emit(e="saved", step=step)
        rep = h.wait_replicated()
        emit(e="replicated", step=step, k_safe=bool(rep["k_safe"]), memory_only=bool(rep["memory_only"]))
        if rep["memory_only"] and os.environ.get("GLOO_SOAK_HOLD_MEMORY") == "1":
            # Aimed: the job is killed (and a machine lost) while a replicated memory-only
            # step is the newest, before the next save.
            emit(e="holding", step=step)
            while True:
                time.sleep(1)
        dist.barrier()
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    emit(e="closed")


if __name__ == "__main__":
    main()
