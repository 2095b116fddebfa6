"""A save right after its previous checkpoint was deleted: is its staging slower?

One native Checkpointer (no keep_last) saves STATE GiB of CPU bf16 tensors (1,312 by
default) four times, each durable before the next; after each save, per --mode: `keep`
(nothing deleted), `delete` (the step directory just written is removed), `delete-sync`
(removed, then os.sync()), `delete-sleep` (removed, then 6 s). Prints each save's
blocking time (the stall). Found with benches/dcp/idle_stall.py: until 54acafb a save
right after a deletion paid for it (the engine held the deleted file's last descriptor,
and closing it in save() trimmed the freed blocks synchronously on a `discard` mount);
kept as the check that it does not come back (benches/JOURNAL.md).

python3 benches/host/delete_then_save.py --dir DIR [--gib 2] --mode delete
"""
import argparse
import os
import shutil
import tempfile
import time

import torch

import shmckpt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--gib", type=float, default=2)
    p.add_argument("--tensors", type=int, default=1312)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--mode", default="delete", choices=["keep", "delete", "delete-sync", "delete-sleep"])
    a = p.parse_args()
    per = int(a.gib * (1 << 30)) // a.tensors // 2
    state = {f"l{i}": torch.randn(per).to(torch.bfloat16) for i in range(a.tensors)}
    cap = sum(t.numel() * 2 for t in state.values()) + (256 << 20)
    base = tempfile.mkdtemp(dir=a.dir)
    ck = shmckpt.Checkpointer(base, tuning=shmckpt.Tuning(staging_capacity=cap))
    out = []
    try:
        for i in range(1, a.saves + 1):
            t = time.perf_counter()
            h = ck.save(i, state)
            out.append(time.perf_counter() - t)
            h.wait()
            if a.mode != "keep":
                (d,) = [os.path.join(base, e) for e in os.listdir(base) if e == f"step-{i}"]
                shutil.rmtree(d)
                if a.mode == "delete-sync":
                    os.sync()
                elif a.mode == "delete-sleep":
                    time.sleep(6)
    finally:
        ck.close()
        shutil.rmtree(base)
    print(a.mode, " ".join(f"{x:.3f}" for x in out))


if __name__ == "__main__":
    main()
