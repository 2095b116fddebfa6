#!/usr/bin/env python3
"""Draw sweep.png from a sweep.json written by sweep.py: overhead (%) against the
checkpoint interval (s), one panel per step length, one line per system (median of its
checkpoint windows, bars from the lowest to the highest window), the 1 % line, and the
band of the none segments' drift (each none segment's mean against the pooled none mean).
Hollow markers: the disk did not keep up at that interval.

    python3 benches/train/plot_sweep.py DIR/sweep.json [OUT.png]

Needs matplotlib (not on the H200 machine: run it where it is installed).
"""

import json
import os
import sys

COLORS = {
    "torch": "tab:brown",
    "dcp": "tab:red",
    "dcp-shm": "tab:purple",
    "nvrx": "tab:orange",
    "nvrx-fswa": "tab:pink",
    "shm-block": "tab:blue",
    "shm-async": "tab:green",
    "shm-snap": "tab:olive",
}


def plot(json_path, png_path=None):
    """Write the plot of ``json_path`` to ``png_path`` (default: beside it, sweep.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        res = json.load(f)
    png_path = png_path or os.path.join(os.path.dirname(os.path.abspath(json_path)), "sweep.png")
    summ = res.get("summary", {})
    n = max(1, len(summ))
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.8), squeeze=False)
    for ax, (sm, per) in zip(axes[0], summ.items()):
        d = per["none_drift_pct"]
        if d["min"] is not None:
            ax.axhspan(d["min"], d["max"], color="0.85", label="none drift")
        ax.axhline(1.0, color="k", ls="--", lw=0.8, label="1 %")
        for name, s in per["systems"].items():
            rows = s["intervals"]
            if not rows:
                continue
            xs = [r["interval_s"] for r in rows]
            ys = [r["overhead_pct_median"] for r in rows]
            lo = [r["overhead_pct_median"] - r["overhead_pct_min"] for r in rows]
            hi = [r["overhead_pct_max"] - r["overhead_pct_median"] for r in rows]
            c = COLORS.get(name)
            ax.errorbar(xs, ys, yerr=[lo, hi], color=c, marker="o", ms=4, capsize=2, lw=1.2, label=name)
            behind = [(x, y) for x, y, r in zip(xs, ys, rows) if not r["kept_up"]]
            if behind:
                ax.scatter([b[0] for b in behind], [b[1] for b in behind], s=50, facecolors="white", edgecolors=c, zorder=3)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("checkpoint interval (s)")
        ax.set_ylabel("overhead (%)")
        L = next((x for x in res.get("step_lengths", []) if str(x["step_ms"]) == str(sm)), None)
        ttl = f"step ~{sm} ms"
        if L:
            ttl += f" (batch {L['batch']}, {L['calibrated_step_s'] * 1e3:.0f} ms measured)"
        ax.set_title(ttl, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    m = res.get("meta", {})
    fig.suptitle(
        f"Overhead vs checkpoint interval: {m.get('state_bytes', 0) / 2**30:.2f} GiB state, {m.get('gpu') or 'cpu'}, {m.get('started', '')}; "
        f"disk-bound minimum {res.get('i_min_s', 0):.2f} s",
        fontsize=10,
    )
    axes[0][-1].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    print(plot(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
