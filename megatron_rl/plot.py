"""Reward and accuracy curves from metrics.jsonl, against wall time, as a PNG.

    python -m megatron_rl.plot RUN_DIR [--baseline SYNC_RUN_DIR] [--out PNG]
"""

from __future__ import annotations

import argparse
import json
import os


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(runs: dict[str, str], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, run_dir in runs.items():
        rows = [r for r in read_metrics(run_dir) if "rollout" in r]  # RL steps (evaluations have rows of their own)
        t = [r["perf"]["time_s"] for r in rows]
        axes[0].plot(t, [r["rollout"]["reward_mean"] for r in rows], marker=".", label=label)
        axes[1].plot(t, [r["rollout"]["accuracy"] for r in rows], marker=".", label=label)
        eval_path = os.path.join(run_dir, "eval.json")
        after = None
        if os.path.exists(eval_path):
            with open(eval_path) as f:
                after = json.load(f).get("accuracy_after_rl")  # none without an evaluation set
        if after is not None:
            axes[1].axhline(after, linestyle="--", linewidth=1, color=axes[1].lines[-1].get_color(),
                            label=f"{label}: held-out after RL")
    for ax, title in zip(axes, ("reward (mean over sampled rollouts)", "accuracy (sampled; dashed: held-out greedy)")):
        ax.set_xlabel("wall time of RL (s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--baseline", help="a synchronous run to draw beside it")
    p.add_argument("--out", help="default: RUN_DIR/reward_curve.png")
    args = p.parse_args(argv)
    runs = {"async (AIPO)": args.run_dir}
    if args.baseline:
        runs["sync baseline"] = args.baseline
    print(plot(runs, args.out or os.path.join(args.run_dir, "reward_curve.png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
