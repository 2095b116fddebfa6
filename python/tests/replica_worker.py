"""Child process of test_replicas.py (not a test module): one rank of a world of 4 ranks
over gloo on one host, ranks 0-1 on simulated machine "m0" and 2-3 on "m1" (``node=``).

    python replica_worker.py save ROOT RANK WORLD PORT OUT REPLICAS STEP...
        save each STEP (non-blocking) and wait_replicated() after it (REPLICAS > 0);
        with REPLICA_WORKER_DIE=RANK:STEP that rank kills itself once its save of STEP is
        durable, before replicating it, and with RANK:STEP:mid once it has sent the first
        piece of its image of STEP (its second ``isend``: the middle of the transfer);
        with REPLICA_WORKER_NOWAIT=1 every step is saved first and wait_replicated() called
        afterwards, newest step first; with REPLICA_WORKER_GOON=1 the ranks go on saving
        after a failed replication (no barrier after it), recording each failure;
        REPLICA_WORKER_BW / REPLICA_WORKER_TIMEOUT: replica_bandwidth / replica_timeout;
        REPLICA_WORKER_CHUNK / REPLICA_WORKER_STAGING: chunk_size / staging_capacity;
        with REPLICA_WORKER_PRESSURE=mid (steps 1 2): step 2 is saved once the first piece
        of this rank's image of step 1 was taken (its replication still going on), its
        ``wait()`` timed, then the replica of step 1 this rank holds compared byte for byte
        with its source's committed file; with =before, the same, but step 2 is saved
        (and waited for) before the replication of step 1 may begin its exchange;
        REPLICA_WORKER_REMOTE=URL: remote=URL, each step also waited for in the bucket;
        REPLICA_WORKER_NODE_LOCAL=1: node_local_root=True, and ROOT's "{m}" is the
        machine's number (a root per machine); REPLICA_WORKER_KEEP_LAST: keep_last;
        REPLICA_WORKER_LIE=RANK:DELTA: that rank's images claim DELTA bytes more than the
        committed file holds (announced, and sent: the last piece padded with zeros or cut);
        REPLICA_WORKER_DISK_EVERY=N: disk_every=N (no kept arena), and with
        REPLICA_WORKER_LOAD_AFTER=1 "latest" is loaded after the saves (before close);
        REPLICA_WORKER_KILL_AFTER=1: once every step is saved and replicated, the report is
        written and the rank SIGKILLs itself (no close(): a memory-only step stays in its
        staging arena, for recovery at the next open);
        REPLICA_WORKER_GATE=1: no replication begins its exchange before every STEP is
        saved (and waited for); then each step's wait_replicated(), in order;
        REPLICA_WORKER_GIVEUP_MID=1 (steps 1 2 3, disk_every=3, memory_steps=1): step 3 is
        saved once the first piece of this rank's image of the memory-only step 2 was
        taken (staging it gives step 2 up, its chunks back to the pool), then the replica
        of step 2 this rank holds is compared tensor by tensor with its source's state
    python replica_worker.py load ROOT RANK WORLD PORT OUT REPLICAS
        load "latest" (REPLICA_WORKER_LOAD_INTO=1: load_into zeroed tensors;
        REPLICA_WORKER_LOAD_STEP=N: load step N) and compare it with the state saved of
        the step loaded, bit for bit (with
        REPLICA_WORKER_DIE=RANK:load that rank kills itself before loading)

OUT receives a JSON report.
"""

import hashlib
import json
import os
import sys
import time

import torch


def rank_state(rank, step):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return {
        "model": {
            "w": torch.randn(256, 130, generator=g),
            "h": torch.randn(77, generator=g).to(torch.bfloat16),
            "i": torch.randint(-(2**40), 2**40, (rank + 3,), generator=g),
        },
        "step": step,
        "who": f"rank {rank}",
    }


def digest(state):
    h = hashlib.sha256()
    for k in ("w", "h", "i"):
        t = state["model"][k]
        h.update(str((k, t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(repr((state["step"], state["who"])).encode())
    return h.hexdigest()


def open_ckpt(root, rank, replicas):
    import shmckpt

    extra = {}
    reps = {"node": f"m{rank // 2}"}
    if os.environ.get("REPLICA_WORKER_BW"):
        bw = os.environ["REPLICA_WORKER_BW"]
        reps["bandwidth"] = None if bw == "none" else float(bw)
    if os.environ.get("REPLICA_WORKER_NODE_LOCAL") == "1":
        reps["node_local_root"] = True
        root = root.format(m=rank // 2)
    if os.environ.get("REPLICA_WORKER_KEEP_LAST"):
        extra["keep_last"] = int(os.environ["REPLICA_WORKER_KEEP_LAST"])
    if os.environ.get("REPLICA_WORKER_REMOTE"):
        extra["remote"] = os.environ["REPLICA_WORKER_REMOTE"]
    if os.environ.get("REPLICA_WORKER_TIMEOUT"):
        reps["timeout"] = float(os.environ["REPLICA_WORKER_TIMEOUT"])
    keep = True
    if os.environ.get("REPLICA_WORKER_DISK_EVERY"):
        extra["cadence"] = shmckpt.Cadence(disk_every=int(os.environ["REPLICA_WORKER_DISK_EVERY"]))
        keep = False
    return shmckpt.Checkpointer(
        root,
        tuning=shmckpt.Tuning(
            staging_capacity=int(os.environ.get("REPLICA_WORKER_STAGING", 8 << 20)),
            chunk_size=int(os.environ.get("REPLICA_WORKER_CHUNK", 1 << 20)),
        ),
        keep_in_memory=keep,
        replicas=shmckpt.Replicas(k=replicas, **reps),
        **extra,
    )


def die_mid_transfer(n=2, before=None):
    """Kill this process at its ``n``-th ``isend`` (by default the second: after the first
    piece of its image went), calling ``before()`` first when given."""
    import torch.distributed as dist

    real = dist.isend
    calls = []

    def isend(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            if before is not None:
                before()
            os.kill(os.getpid(), 9)
        return real(*args, **kwargs)

    dist.isend = isend


def first_piece_event():
    """An event set once this rank's replication took the first piece of its image."""
    import threading

    from shmckpt import _replica_net

    ev = threading.Event()
    real = _replica_net.ImagePieces.piece

    def piece(self, a, b):
        t = real(self, a, b)
        ev.set()
        return t

    _replica_net.ImagePieces.piece = piece
    return ev


def lie_about_size(delta):
    """This rank's images claim ``delta`` bytes more than the file holds: their size, and
    the bytes sent (the last piece padded with zeros, or cut short)."""
    from shmckpt import _replica_net

    real_init = _replica_net.ImagePieces.__init__
    real_piece = _replica_net.ImagePieces.piece

    def init(self, source, held, rank):
        real_init(self, source, held, rank)
        self.true_nbytes = self.nbytes
        self.nbytes += delta

    def piece(self, a, b):
        t = real_piece(self, a, min(b, self.true_nbytes))
        if t.numel() < b - a:
            t = torch.cat([t, torch.zeros(b - a - t.numel(), dtype=torch.uint8)])
        return t

    _replica_net.ImagePieces.__init__ = init
    _replica_net.ImagePieces.piece = piece


def replica_matches_file(root, step, src):
    """Whether this user's replica of ``src``'s image of ``step`` holds exactly the bytes of
    ``src``'s committed file."""
    from shmckpt import _shmckpt

    m = json.load(open(os.path.join(root, f"step-{step}", "manifest.json")))
    (f,) = [f for f in m["files"] if f["rank"] == src]
    with open(os.path.join(root, f"step-{step}", f["file"]), "rb") as fh:
        want = fh.read()
    with open(os.path.join("/dev/shm", _shmckpt.replica_name(root, src, step)), "rb") as fh:
        return fh.read() == want


def pressure(ck, rank, res, mode):
    """REPLICA_WORKER_PRESSURE=mid|before (see the module)."""
    import threading

    first = first_piece_event()
    go = threading.Event()
    if mode == "before":
        real = ck._replicator._replicate

        def gated(*args, **kwargs):
            assert go.wait(60)
            return real(*args, **kwargs)

        ck._replicator._replicate = gated
    else:
        go.set()
    h1 = ck.save(1, rank_state(rank, 1), blocking=False)
    if mode == "before":
        h1.wait()
    else:
        assert first.wait(60)
    t0 = time.monotonic()
    h2 = ck.save(2, rank_state(rank, 2), blocking=False)
    h2.wait()
    res["save2_seconds"] = time.monotonic() - t0
    go.set()
    for step, h in ((1, h1), (2, h2)):
        rep = h.wait_replicated()
        if step == 1:
            res["replica1_exact"] = replica_matches_file(ck.root, 1, ck._replicator.plan.index([rank]))
        rep["holders"] = {str(k): v for k, v in rep["holders"].items()}
        res["reports"].append(rep)


def give_up_mid(ck, rank, res):
    """REPLICA_WORKER_GIVEUP_MID=1 (see the module)."""
    import threading

    import safetensors.torch

    from shmckpt import _shmckpt

    first = first_piece_event()
    go3 = threading.Event()
    real = ck._replicator._replicate

    def gated(step, *args, **kwargs):
        if step == 3:
            assert go3.wait(60)
        return real(step, *args, **kwargs)

    ck._replicator._replicate = gated
    hs = [ck.save(1, rank_state(rank, 1), blocking=False)]
    hs[0].wait_replicated()
    first.clear()
    hs.append(ck.save(2, rank_state(rank, 2), blocking=False))
    hs[1].wait()
    assert first.wait(60)  # step 2's image is being sent
    hs.append(ck.save(3, rank_state(rank, 3), blocking=False))
    hs[2].wait()
    res["held_after_3"] = [[int(s), list(t)] for s, t in ck.list(tiers=True)]
    hs[1].wait_replicated()
    src = ck._replicator.plan.index([rank])
    with open(os.path.join("/dev/shm", _shmckpt.replica_name(ck.root, src, 2)), "rb") as f:
        got = safetensors.torch.load(f.read())
    want = rank_state(src, 2)["model"]
    res["replica2_exact"] = sorted(got) == [f"model.{k}" for k in sorted(want)] and all(
        torch.equal(got[f"model.{k}"].view(torch.uint8), t.contiguous().view(torch.uint8)) for k, t in want.items()
    )
    go3.set()
    for h in hs:
        rep = h.wait_replicated()
        rep["holders"] = {str(k): v for k, v in rep["holders"].items()}
        res["reports"].append(rep)


def main():
    mode, root, rank, world, port, out, replicas = sys.argv[1:8]
    rank, world, replicas = int(rank), int(world), int(replicas)
    import torch.distributed as dist

    import shmckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = {"rank": rank}
    ck = open_ckpt(root, rank, replicas)
    res["shm_name"] = ck.shm_name
    lie = os.environ.get("REPLICA_WORKER_LIE", "").split(":")
    if lie[0] == str(rank):
        lie_about_size(int(lie[1]))
    if mode == "save":
        res["reports"] = []
        die = os.environ.get("REPLICA_WORKER_DIE")  # "RANK:STEP": killed after its save
        steps = [int(s) for s in sys.argv[8:]]
        if os.environ.get("REPLICA_WORKER_PRESSURE"):
            pressure(ck, rank, res, os.environ["REPLICA_WORKER_PRESSURE"])
            steps = []
        if os.environ.get("REPLICA_WORKER_GIVEUP_MID") == "1":
            give_up_mid(ck, rank, res)
            steps = []
        if os.environ.get("REPLICA_WORKER_GATE") == "1":
            import threading

            go = threading.Event()
            real = ck._replicator._replicate

            def gated(*args, **kwargs):
                assert go.wait(60)
                return real(*args, **kwargs)

            ck._replicator._replicate = gated
            hs = [ck.save(step, rank_state(rank, step), blocking=False) for step in steps]
            for h in hs:
                h.wait()
            go.set()
            steps = []
            for h in hs:
                rep = h.wait_replicated()
                rep["holders"] = {str(k): v for k, v in rep["holders"].items()}
                res["reports"].append(rep)
        if os.environ.get("REPLICA_WORKER_NOWAIT") == "1":
            # Save every step without waiting, then wait for the replications, newest first.
            hs = [ck.save(step, rank_state(rank, step), blocking=False) for step in steps]
            steps = []
            for h in reversed(hs):
                rep = h.wait_replicated()
                rep["holders"] = {str(k): v for k, v in rep["holders"].items()}
                res["reports"].append(rep)
        goon = os.environ.get("REPLICA_WORKER_GOON") == "1"
        broken = False
        for step in steps:
            t0 = time.monotonic()
            h = ck.save(step, rank_state(rank, step), blocking=False)
            if die == f"{rank}:{step}":
                h.wait()
                os.kill(os.getpid(), 9)
            if die == f"{rank}:{step}:mid":
                die_mid_transfer()
            if replicas > 0:
                try:
                    rep = h.wait_replicated()
                except shmckpt.ReplicationError as e:
                    h.wait()
                    res.setdefault("error", type(e).__name__)
                    res.setdefault("failed_step", step)
                    res.setdefault("failures", []).append(
                        {"step": step, "message": str(e), "seconds": time.monotonic() - t0}
                    )
                    if not goon:
                        # The group is broken: report and leave without another collective.
                        ck.close()
                        with open(out, "w") as f:
                            json.dump(res, f)
                        os._exit(0)
                    broken = True
                    continue
                rep["holders"] = {str(k): v for k, v in rep["holders"].items()}
                res["reports"].append(rep)
                if os.environ.get("REPLICA_WORKER_REMOTE"):
                    h.wait_remote()
            else:
                h.wait()
                try:
                    h.wait_replicated()
                    res["wait_replicated"] = "returned"
                except shmckpt.ConfigError as e:
                    res["wait_replicated"] = type(e).__name__
            if not broken:
                dist.barrier()
        if broken:  # a rank is dead: no more collectives
            ck.close()
            with open(out, "w") as f:
                json.dump(res, f)
            os._exit(0)
        if os.environ.get("REPLICA_WORKER_KILL_AFTER") == "1":
            with open(out, "w") as f:
                json.dump(res, f)
            os.kill(os.getpid(), 9)
        if os.environ.get("REPLICA_WORKER_LOAD_AFTER") == "1":
            state = ck.load("latest")
            src = ck.last_load_source
            res["after"] = {
                "step": state["step"],
                "exact": digest(state) == digest(rank_state(rank, state["step"])),
                "source": None if src is None else [src[0], src[1]],
            }
    else:
        if os.environ.get("REPLICA_WORKER_DIE") == f"{rank}:load":
            os.kill(os.getpid(), 9)
        try:
            if os.environ.get("REPLICA_WORKER_LOAD_INTO") == "1":
                # In place into zeroed tensors of the saved shapes (the step is "latest").
                step = ck.latest()
                state = rank_state(rank, step)
                for t in state["model"].values():
                    t.zero_()
                step = ck.load_into({"model": state["model"]}).step
                state["step"] = step
            else:
                want = os.environ.get("REPLICA_WORKER_LOAD_STEP")
                state = ck.load("latest" if want is None else int(want))
                step = state["step"]  # "latest": the newest step every rank can load
            res["step"] = step
            res["exact"] = digest(state) == digest(rank_state(rank, step))
            src = ck.last_load_source
            res["source"] = None if src is None else [src[0], src[1]]
        except shmckpt.ShmckptError as e:
            res["error"] = type(e).__name__
            res["message"] = str(e)
            if os.environ.get("REPLICA_WORKER_DIE"):  # a rank is dead: no more collectives
                ck.close()
                with open(out, "w") as f:
                    json.dump(res, f)
                os._exit(0)
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
