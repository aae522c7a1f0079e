"""Reward and accuracy curves from metrics.jsonl, against wall time, as a PNG.

    python -m megatron_rl.observability.plots RUN_DIR [--baseline BASELINE_RUN_DIR] [--out PNG]
        [--label NAME --baseline-label NAME]

With a baseline it also says when the run first reached the baseline's final held-out accuracy, as a fraction of
the baseline's RL wall time (RUN_DIR/compare_baseline.json). Runs with agent rollouts get a fourth panel: tool
calls per trajectory.
"""

from __future__ import annotations

import argparse
import json
import os

from megatron_rl.observability.accounting import read_jsonl


def read_metrics(run_dir: str) -> list[dict]:
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def held_out_curve(rows: list[dict]) -> list[tuple[float, int, float]]:
    """(RL wall time s, step, accuracy) of each evaluation of the run's first evaluation set; before RL at 0 s."""
    points = []
    for r in rows:
        evaluations = r.get("eval")
        if evaluations:
            accuracy = next(iter(evaluations.values()))["accuracy"]
            points.append((r["perf"]["time_s"] if "perf" in r else 0.0, r["step"], accuracy))
    return points


def time_to_reach(run_dir: str, baseline_dir: str) -> dict:
    """When the run's held-out accuracy first reached the baseline's final one, against the baseline's RL time."""
    run, base = held_out_curve(read_metrics(run_dir)), held_out_curve(read_metrics(baseline_dir))
    if not run or not base:
        raise ValueError(f"{run_dir if not run else baseline_dir}: no held-out evaluations in metrics.jsonl")
    target, base_time = base[-1][2], base[-1][0]
    reached = next(((t, step) for t, step, acc in run if acc is not None and acc >= target), None)
    out = {"baseline_final_accuracy": target, "baseline_rl_seconds": base_time, "run_final_accuracy": run[-1][2],
           "run_rl_seconds": run[-1][0], "reached_at_seconds": None, "reached_at_step": None, "time_ratio": None}
    if reached is not None:
        out.update(reached_at_seconds=reached[0], reached_at_step=reached[1], time_ratio=reached[0] / base_time)
    return out


def plot(runs: dict[str, str], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = {label: [r for r in read_metrics(run_dir) if "rollout" in r]  # RL steps (evaluations have own rows)
             for label, run_dir in runs.items()}
    agentic = any("agent_tool_calls_mean" in r["rollout"] for rows in steps.values() for r in rows)
    fig, axes = plt.subplots(1, 4 if agentic else 3, figsize=(21 if agentic else 16, 4))
    for label, run_dir in runs.items():
        rows = steps[label]
        t = [r["perf"]["time_s"] for r in rows]
        axes[0].plot(t, [r["rollout"]["reward_mean"] for r in rows], marker=".", label=label)
        axes[1].plot(t, [r["rollout"]["accuracy"] for r in rows], marker=".", label=label)
        if agentic:
            axes[3].plot(t, [r["rollout"].get("agent_tool_calls_mean", 0.0) for r in rows], marker=".", label=label)
        curve = held_out_curve(read_metrics(run_dir))
        axes[2].plot([c[0] for c in curve], [c[2] for c in curve], marker="o", label=label)
        eval_path = os.path.join(run_dir, "eval.json")
        after = None
        if os.path.exists(eval_path):
            with open(eval_path) as f:
                after = json.load(f).get("accuracy_after_rl")  # none without an evaluation set
        if after is not None:
            axes[1].axhline(after, linestyle="--", linewidth=1, color=axes[1].lines[-1].get_color(),
                            label=f"{label}: held-out after RL")
    titles = ("reward (mean over sampled rollouts)", "accuracy (sampled; dashed: held-out greedy)",
              "held-out accuracy (greedy) at each evaluation", "tool calls per trajectory (sampled)")
    for ax, title in zip(axes, titles):
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
    p.add_argument("--baseline", help="a run to draw beside it (the synchronous baseline, say)")
    p.add_argument("--out", help="default: RUN_DIR/reward_curve.png")
    p.add_argument("--label", default="async (AIPO)", help="the run's name in the legend")
    p.add_argument("--baseline-label", default="sync baseline", help="the baseline's name in the legend")
    p.add_argument("--plot-only", action="store_true",
                   help="draw the baseline without the time-to-reach comparison (a baseline of another task setup)")
    args = p.parse_args(argv)
    runs = {args.label: args.run_dir}
    if args.baseline:
        runs[args.baseline_label] = args.baseline
    print(plot(runs, args.out or os.path.join(args.run_dir, "reward_curve.png")))
    if args.baseline and not args.plot_only:
        result = time_to_reach(args.run_dir, args.baseline)
        with open(os.path.join(args.run_dir, "compare_baseline.json"), "w") as f:
            json.dump(result, f, indent=1)
        reached = "never reached it" if result["time_ratio"] is None else \
            f"reached it at {result['reached_at_seconds']:.0f} s of RL (step {result['reached_at_step']}), " \
            f"{result['time_ratio']:.2f}x the baseline's {result['baseline_rl_seconds']:.0f} s"
        print(f"baseline's final held-out accuracy {result['baseline_final_accuracy']:.3f}; the run "
              f"({result['run_final_accuracy']:.3f} at the end) {reached}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
