"""Running the ranks of a multi-process test: one worker process per rank, each of which
must exit 0 (test_dcp.py, test_megatron.py and test_export.py read their results)."""

import os
import subprocess
import sys
import zygote


def run_ranks(worker, scenario, world, workdir, *args, env=None, timeout=240, preload=()):
    """Run ``python WORKER SCENARIO RANK WORLD WORKDIR *ARGS`` for every rank at once, one
    thread for OpenMP unless ``env`` says otherwise; kill them all if one outlives
    ``timeout``; assert each exited 0 (the failing rank's output in the message)."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        zygote.spawn(
            [sys.executable, str(worker), scenario, str(r), str(world), str(workdir), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preload=preload,
        )
        for r in range(world)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out.decode(errors="replace"))
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} of {scenario} exited {p.returncode}:\n{out[-6000:]}"
