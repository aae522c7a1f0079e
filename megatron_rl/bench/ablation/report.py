"""docs/ablations.md and docs/ablations.png from the ablation's summary.json.

The markdown's reading is generated from the numbers by the rules `reading` states (which ranges over seeds lie
apart, where the uncorrected loss loses accuracy, how far the behavior policy is from the trained one), never
written in advance; a marked section is left for a person's reading.
"""

from __future__ import annotations

import math
import os

BASELINE = "reinforce"
SMALL_KL = 0.01  # below this mean k3 KL(mu || pi) the importance weights stay near 1 and the losses nearly agree

LOSS_TEXT = {
    "aipo": "-sg(min(pi/mu, rho)) A log pi: the importance weight truncated above at rho (--aipo-rho), held constant",
    "reinforce": "-A log pi: no correction; the on-policy estimator applied to lagged data (the baseline)",
    "ppo": "PPO's clipped surrogate of pi/mu: the ratio clipped to [1 - eps, 1 + eps] (--ppo-clip-eps)",
    "tis": "PPO's surrogate of pi/pi_prox times sg(min(pi_prox/mu, C)) (--tis-clip); with one optimizer step per "
           "batch pi_prox = pi, so it is a truncated importance weight, aipo's gradient with rho = C",
    "icepop": "-sg(pi/mu) A log pi on tokens whose pi/mu lies in [--is-mask-low, --is-mask-high]; tokens outside "
              "are masked",
    "aipo-clamp": "-clamp(pi/mu, max=rho) A: the clamped weight without the stop-gradient",
    "gspo": "the clipped surrogate of each sequence's geometric-mean ratio (GSPO)",
    "cispo": "-sg(clip(pi/mu, 1 - eps_low, 1 + eps_high)) A log pi (MiniMax-M1's CISPO)",
    "decoupled-ppo": "AReaL's decoupled PPO: the surrogate of pi/pi_prox times the behavior weight pi_prox/mu",
}


def fmt(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def fmt_spread(s: dict | None, digits: int = 3) -> str:
    """"mean [min, max]" (a single run: its value)."""
    if s is None:
        return "n/a"
    if s["n"] == 1:
        return fmt(s["mean"], digits)
    return f"{fmt(s['mean'], digits)} [{fmt(s['min'], digits)}, {fmt(s['max'], digits)}]"


def cell(summary: dict, lag: int, loss: str) -> dict | None:
    return next((c for c in summary["cells"] if (c["lag"], c["loss"]) == (lag, loss)), None)


def resolution(summary: dict) -> float:
    """The held-out set's resolution: the largest standard error of one accuracy measured on its n problems,
    0.5 / sqrt(n) (at accuracy 0.5); 0 when n is unknown."""
    n = min(summary["distinct_problems"], default=0)
    return 0.5 / math.sqrt(n) if n else 0.0


def compare(a: dict | None, b: dict | None, margin: float) -> str | None:
    """"above" when every seed of `a` beats every seed of `b` by more than `margin` (min(a) - max(b) > margin),
    "below" the other way round, "overlap" otherwise; None if either is missing."""
    if a is None or b is None:
        return None
    if a["min"] - b["max"] > margin:
        return "above"
    if b["min"] - a["max"] > margin:
        return "below"
    return "overlap"


# ---- the reading ---------------------------------------------------------------------------------------------------

def reading(summary: dict) -> list[str]:
    """Sentences generated from the numbers, each by a stated rule: lag 0 as a sanity check, each lag's correcting
    losses against the uncorrected one, the uncorrected loss across lags, and whether the claim reproduces (and
    if not, which of the measured reasons apply)."""
    grid = summary["grid"]
    lags, losses, seeds = grid["lags"], grid["losses"], len(grid["seeds"])
    out = []
    if grid["quick"]:
        out.append("This is a --quick smoke run (a few RL steps after a tiny warm-up): its numbers test the tool, "
                   "not the claim.")
    if seeds < 2:
        out.append(f"{seeds} seed: every range below is a single run, so no comparison here separates an effect from "
                   "seed-to-seed noise.")
    margin = resolution(summary)
    out.append(f"Rule: a loss is above (below) another at a lag when its final accuracy on every seed exceeds (falls "
               f"short of) the other's on every seed by more than the held-out set's resolution {margin:.3f} (0.5 / "
               "sqrt(distinct problems): the largest standard error of one measured accuracy); otherwise the ranges "
               "overlap.")
    out += lag_zero_sentences(summary, lags, losses, margin)
    if BASELINE not in losses:
        out.append(f"The grid has no uncorrected baseline ({BASELINE}), so no sentence compares a correction with "
                   "none.")
        return out
    corrections = [loss for loss in losses if loss != BASELINE]
    separated = {}
    for lag in [k for k in lags if k > 0]:
        sentence, above = lag_sentence(summary, lag, corrections, margin)
        out.append(sentence)
        separated[lag] = above
    out += verdict(summary, lags, separated, margin)
    return out


def lag_zero_sentences(summary: dict, lags: list[int], losses: list[str], margin: float) -> list[str]:
    """At lag 0 pi = mu, so every loss's gradient is the uncorrected one: how far apart the losses' mean final
    accuracies are, against the largest seed-to-seed range of one loss and the held-out set's resolution."""
    if 0 not in lags or len(losses) < 2:
        return []
    spreads = [c["final_accuracy"] for c in (cell(summary, 0, loss) for loss in losses) if c and c["final_accuracy"]]
    if len(spreads) < 2:
        return []
    means = [s["mean"] for s in spreads]
    seed_range = max(s["max"] - s["min"] for s in spreads)
    across = max(means) - min(means)
    judged = ("as expected" if across <= max(seed_range, margin) else
              "more than both: the losses' code paths differ numerically at lag 0, look there first")
    return [f"Lag 0 (sanity check: pi = mu, so every loss computes the uncorrected gradient): the losses' mean final "
            f"accuracies lie within {across:.3f} of each other ({fmt(min(means))} to {fmt(max(means))}); the largest "
            f"seed-to-seed range of one loss is {seed_range:.3f}, the resolution {margin:.3f}: {judged}."]


def lag_sentence(summary: dict, lag: int, corrections: list[str], margin: float) -> tuple[str, list[str]]:
    """The correcting losses at `lag` by `compare` against the baseline's final accuracy; returns the sentence and
    those above it on every seed."""
    base = cell(summary, lag, BASELINE)
    groups: dict[str, list[str]] = {"above": [], "below": [], "overlap": []}
    for loss in corrections:
        c = cell(summary, lag, loss)
        relation = compare(c and c["final_accuracy"], base and base["final_accuracy"], margin)
        if relation:
            groups[relation].append(loss)
    text = lambda losses: ", ".join(f"{loss} {fmt_spread(cell(summary, lag, loss)['final_accuracy'])}"  # noqa: E731
                                    for loss in losses)
    parts = [f"{name}: {text(groups[key])}" for key, name in
             (("above", "above it on every seed"), ("below", "below it on every seed"), ("overlap", "ranges overlap"))
             if groups[key]]
    baseline = fmt_spread(base["final_accuracy"]) if base else "n/a"
    sentence = f"Lag {lag}: final held-out accuracy of {BASELINE} {baseline}; " + ("; ".join(parts) or
                                                                                    "no correction ran") + "."
    return sentence, groups["above"]


def verdict(summary: dict, lags: list[int], separated: dict[int, list[str]], margin: float) -> list[str]:
    """The claim "off-policy correction matters as the lag grows", taken as: at the largest lag some correction ends
    above the uncorrected loss (`compare`); not judged when RL did not learn at the smallest lag. Then the
    measured facts that bear on it: which losses lose accuracy with lag, how far behavior and trained policies
    are apart, what the corrections clipped or masked, and how many seeds there are."""
    low, high = min(lags), max(lags)
    if high == 0:
        return ["The grid has no lag above 0, so it says nothing about the claim."]
    others = [lag for lag, above in separated.items() if above and lag != high]
    also = f" (some also at lag {', '.join(map(str, others))})" if others else ""
    stalled = no_learning(summary, low, margin)
    if stalled:
        out = [f"The claim is not judged: {stalled}"]
    elif separated.get(high):
        out = [f"The claim reproduces here: at the largest lag ({high}) {', '.join(separated[high])} end above "
               f"{BASELINE}{also}."]
    else:
        out = [f"The claim does not reproduce here: at the largest lag ({high}) no correction ends above "
               f"{BASELINE}{also}."]
    return out + [lag_loss_sentence(summary, low, high, margin)] + distance_sentences(summary, high)


def no_learning(summary: dict, lag: int, margin: float) -> str | None:
    """Why no lag effect can show when RL did not raise the uncorrected loss's held-out accuracy at `lag` by more
    than the resolution (its best final seed against its best seed before RL); None when it did."""
    base = cell(summary, lag, BASELINE)
    if not (base and base["final_accuracy"] and base["accuracy_before_rl"]):
        return None
    if base["final_accuracy"]["max"] - base["accuracy_before_rl"]["max"] > margin:
        return None
    return (f"at lag {lag} RL did not raise {BASELINE}'s held-out accuracy by more than the resolution (before RL "
            f"{fmt_spread(base['accuracy_before_rl'])}, after {fmt_spread(base['final_accuracy'])}), so there is no "
            "learning for a lag to spoil.")


def lag_loss_sentence(summary: dict, low: int, high: int, margin: float) -> str:
    """Which losses end lower at the largest lag than at the smallest (`compare`)."""
    lower = [loss for loss in summary["grid"]["losses"]
             if compare(*(c and c["final_accuracy"] for c in (cell(summary, high, loss), cell(summary, low, loss))),
                        margin) == "below"]
    tail = "" if BASELINE in lower else (f"; {BASELINE} does not, so there is little for a correction to recover at "
                                         "these lags on this task")
    return f"Measured: losses that end lower at lag {high} than at lag {low} on every seed: " \
           f"{', '.join(lower) or 'none'}{tail}."


def distance_sentences(summary: dict, high: int) -> list[str]:
    """How far the behavior policy is from the trained one at the largest lag, what the corrections did there, and
    the number of seeds."""
    out = []
    kls = [c["kl_behavior_current"]["mean"] for c in summary["cells"] if c["lag"] == high and c["kl_behavior_current"]]
    if kls:
        close = (f" < {SMALL_KL}: the importance weights stay near 1, so the losses compute nearly the same gradient"
                 if max(kls) < SMALL_KL else "")
        out.append(f"Measured: at lag {high} the mean k3 KL(mu || pi) per trained token is at most {max(kls):.2g}"
                   f"{close}.")
    fractions = [(c["loss"], k, s["mean"]) for c in summary["cells"] if c["lag"] == high
                 for k, s in c["fractions"].items() if s]
    if fractions:
        out.append(f"Measured: at lag {high} the corrections acted on these fractions of the trained tokens: " +
                   ", ".join(f"{loss} {k.removesuffix('_fraction')} {v:.2%}" for loss, k, v in fractions) + ".")
    seeds = len(summary["grid"]["seeds"])
    if 2 <= seeds < 3:
        out.append(f"With {seeds} seed(s) an effect smaller than the seed-to-seed spread cannot show.")
    return out


# ---- the markdown --------------------------------------------------------------------------------------------------

def markdown(summary: dict) -> str:
    """docs/ablations.md."""
    grid = summary["grid"]
    sections = [header(summary), losses_table(grid["losses"]), accuracy_table(summary), detail_table(summary),
                rules(summary), "![final held-out accuracy vs lag; accuracy over steps at the largest lag]"
                "(ablations.png)\n", "## Reading (generated from the numbers)\n\n" +
                "\n".join(f"- {s}" for s in reading(summary)) + "\n",
                "## Reading by a person\n\n<!-- HUMAN READING: a person's reading of the figures goes here; "
                "everything above is generated by megatron_rl/bench/ablation/report.py. -->\n_Not written yet._\n",
                cost(summary)]
    return "\n".join(sections)


def header(summary: dict) -> str:
    grid, m = summary["grid"], summary["machine"]
    load = summary["load_average"]
    device = m["gpu"] or "no GPU"
    problems = ", ".join(map(str, summary["distinct_problems"])) or "n/a"
    quick = "\n**A --quick smoke run: too few steps to read anything into.**\n" if grid["quick"] else ""
    failed = (f"\n**{len(summary['failed'])} run(s) failed** and are missing from the tables: " +
              ", ".join(f"lag {f['lag']} {f['loss']} seed {f['seed']}" for f in summary["failed"]) + "\n"
              if summary["failed"] else "")
    return f"""# Off-policy correction vs lag: the ablation
{quick}{failed}
Does correcting for off-policy data matter as the lag grows? Each run trains the main example
(`{summary['recipe']['example']}`, sha256 `{summary['recipe']['sha256'][:12]}`: its task, model and
hyper-parameters) at a controlled lag k (`--controlled-lag k`: every batch trained exactly k weight versions after
the one that generated it, after a ramp of k steps) with one loss and one seed, from a supervised warm-up shared by
the runs of a seed (exported once per seed, loaded with `--load-hf`; RL starts with a fresh Adam state).

- Command: `{summary['command']}`
- Code: commit `{summary['git_commit'] or 'unknown'}`
- Machine: {m['cpu'] or 'unknown CPU'}, {m['cpu_cores']} CPU cores, {device}; {m['system']}, Python {m['python']},
  torch {m['torch']}. Each run: 2 processes (trainer TP=1 and one built-in generator). The machine is shared with
  other work (load average {load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the end), so wall times
  are indicative.
- Grid: lags {grid['lags']} x losses {grid['losses']} x seeds {grid['seeds']}; RL steps per run:
  {grid['train_iters'] or "the example's"}; warm-up steps: {grid['warmup_iters'] or "the example's"}; extra flags:
  `{' '.join(grid['extra_flags']) or 'none'}`.
- Held-out set: {problems} distinct problems (eval.json), greedy, evaluated before RL, every
  {grid['eval_interval']} RL steps and at the end. The set is drawn with the run's seed, so each seed has its own
  (all runs of a seed share one); the spread over seeds includes the spread of the sets.
"""


def losses_table(losses: list[str]) -> str:
    rows = "\n".join(f"| {loss} | {LOSS_TEXT.get(loss, 'see megatron_rl/algorithms/losses/')} |" for loss in losses)
    return ("## The losses\n\nmu: the behavior policy (the generator's log-probs), pi: the policy trained, A: the "
            "group-baseline advantage, sg: stop-gradient; per token. Parameters: the example's flags, else the "
            "defaults of `python -m megatron_rl.train -h`.\n\n| loss | what it computes |\n| --- | --- |\n" + rows +
            "\n")


def accuracy_table(summary: dict) -> str:
    grid = summary["grid"]
    head = "| loss \\ lag | " + " | ".join(map(str, grid["lags"])) + " |\n| --- |" + " --- |" * len(grid["lags"])
    rows = []
    for loss in grid["losses"]:
        values = [cell(summary, lag, loss) for lag in grid["lags"]]
        rows.append(f"| {loss} | " + " | ".join(fmt_spread(c["final_accuracy"]) if c else "n/a" for c in values) + " |")
    return ("## Final held-out accuracy\n\nMean [min, max] over seeds, after the last RL step.\n\n" + head + "\n" +
            "\n".join(rows) + "\n")


def detail_table(summary: dict) -> str:
    target = summary["target_accuracy"]
    head = (f"| lag | loss | final accuracy | seeds reaching {target} | RL steps to {target} | RL seconds to "
            f"{target} | instability events (runs) | k3 KL(mu \\|\\| pi) | clipped / masked tokens | s / RL step |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for c in summary["cells"]:
        fractions = ", ".join(f"{k.removesuffix('_fraction')} {fmt_spread(s, 4)}" for k, s in c["fractions"].items()
                              if s) or "none"
        rows.append(f"| {c['lag']} | {c['loss']} | {fmt_spread(c['final_accuracy'])} | {c['reached']}/{c['seeds']} | "
                    f"{fmt_spread(c['steps_to_target'], 0)} | {fmt_spread(c['rl_seconds_to_target'], 1)} | "
                    f"{c['instability_events']} ({c['runs_with_events']}) | {fmt_spread(c['kl_behavior_current'], 4)} "
                    f"| {fractions} | {fmt_spread(c['seconds_per_step'], 2)} |")
    return ("## Per lag and loss\n\nMean [min, max] over seeds; steps and seconds to the target over the seeds that "
            "reached it.\n\n" + head + "\n" + "\n".join(rows) + "\n")


def rules(summary: dict) -> str:
    r = summary["rules"]
    return (f"Rules. Time to {summary['target_accuracy']}: {r['time_to_target']}. Instability event: "
            f"{r['instability']}. KL and clipped / masked fractions: {r['off_policy_statistics']}; the KL is the k3 "
            "estimate of KL(mu || pi) per trained token (train/kl_behavior_current), the fractions are the loss's "
            "own indicators (train/<indicator>_fraction: clip_high, clip_low, tis_clip, masked). Runs: one "
            "directory each under the output directory, with metrics.jsonl, eval.json and run.log.\n")


def cost(summary: dict) -> str:
    c = summary["cost"]
    return (f"## Cost\n\nAll launches together: {c['launch_seconds_total'] / 60:.1f} min of wall time (the last "
            f"invocation, which skips runs already done: {c['wall_seconds'] / 60:.1f} min). Per warm-up launch: "
            f"{fmt_spread(c['warmup_launch_seconds'], 0)} s; per RL launch: {fmt_spread(c['rl_launch_seconds'], 0)} "
            f"s; per RL step: {fmt_spread(c['seconds_per_rl_step'], 2)} s (a launch includes starting the processes "
            "and every evaluation).\n")


# ---- the figure ----------------------------------------------------------------------------------------------------

def plot(summary: dict, path: str) -> str:
    """Left: final held-out accuracy vs lag, one line per loss, min-max error bars over seeds. Right: held-out
    accuracy over RL steps at the largest lag, per loss, mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_rl.bench.ablation.summary import mean_curve

    grid = summary["grid"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.06 * max(max(grid["lags"]), 1)
    for i, loss in enumerate(grid["losses"]):
        cells = [(lag, cell(summary, lag, loss)) for lag in grid["lags"]]
        points = [(lag, c["final_accuracy"]) for lag, c in cells if c and c["final_accuracy"]]
        if points:
            offset = (i - (len(grid["losses"]) - 1) / 2) * width
            left.errorbar([lag + offset for lag, _ in points], [s["mean"] for _, s in points],
                          yerr=[[s["mean"] - s["min"] for _, s in points], [s["max"] - s["mean"] for _, s in points]],
                          marker="o", capsize=3, label=loss)
        high = max(grid["lags"])
        curve = mean_curve([r["eval_curve"] for r in summary["runs"] if (r["lag"], r["loss"]) == (high, loss)])
        if curve:
            right.plot([s for s, _ in curve], [a for _, a in curve], marker=".", label=loss)
    for ax in (left, right):
        ax.set_ylim(-0.02, 1.02)
        ax.axhline(summary["target_accuracy"], color="gray", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_ylabel("held-out accuracy (greedy)")
    left.set_xticks(grid["lags"])
    left.set_xlabel("controlled lag k (weight versions)")
    left.set_title(f"final accuracy vs lag (mean, min-max over {len(grid['seeds'])} seed(s))")
    right.set_xlabel("RL step")
    right.set_title(f"accuracy over steps at lag {max(grid['lags'])} (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_docs(summary: dict, docs_dir: str) -> list[str]:
    """Write ablations.md and ablations.png into `docs_dir`; returns their paths."""
    os.makedirs(docs_dir, exist_ok=True)
    md, png = os.path.join(docs_dir, "ablations.md"), os.path.join(docs_dir, "ablations.png")
    with open(md, "w") as f:
        f.write(markdown(summary))
    return [md, plot(summary, png)]
