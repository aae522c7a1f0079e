"""Megatron-style command line: Megatron-LM's flag names and meanings where a Megatron flag exists, grouped
like Megatron's, plus the RL groups (rollout, algorithm, reward, data, DDMA). The plug-ins bring their own flags:
each loss its hyperparameters (`algorithms.losses`), each generator backend its group (`rollout.ENGINE_BACKENDS`;
SGLang's passes every server flag through as --sglang-<flag>, `rollout.sglang.arguments`). The choices of --loss,
--advantage-estimator, --loss-aggregation and --rollout-backend are the names in their registries (--reward-fn: a
registered name, checked by the run setup, like --custom-rm-path). `config.validation` checks the flags together
at start, naming flags and values."""

from __future__ import annotations

import argparse
import json
import os
import pathlib

from megatron_rl.algorithms import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS
from megatron_rl.algorithms.losses import add_loss_arguments
from megatron_rl.config.validation import validate
from megatron_rl.models.parallelism import KERNEL_FUSIONS, MOE_TOKEN_DISPATCHERS, TRANSFORMER_IMPLS
from megatron_rl.rewards.registry import REWARD_FUNCTIONS
from megatron_rl.rewards.verdicts import DEFAULT_TEMPLATE, DEFAULT_VERDICT
from megatron_rl.rollout import ENGINE_BACKENDS, ROLLOUT_FUNCTIONS, collect_server_flags
from megatron_rl.runtime.early_exit import SIGNALS

# megatron_rl.tools.sandbox.SANDBOXES, named here so that the flags never import the tools (a test keeps them equal)
PYTHON_SANDBOXES = ("bwrap", "weak")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_rl.train",
        description="Asynchronous off-policy RL (AIPO) on Megatron-Core. Launch with torchrun: the first "
                    "TP x PP x DP ranks train, the rest generate (rollout TP x replicas).",
        allow_abbrev=False,
    )
    g = p.add_argument_group("config")
    g.add_argument("--config", help="a JSON file of flag defaults, by path or by name in configs/ (e.g. llama3-405b); "
                                    "flags on the command line override it")
    g.add_argument("--dry-run", action="store_true",
                   help="validate the layout and print the rank map, per-GPU memory and the DDMA plan; no weights")
    g.add_argument("--world-size", type=int, help="for --dry-run: the launch's world size (default: env WORLD_SIZE)")

    g = p.add_argument_group("model")
    g.add_argument("--model", default="tiny-arith",
                   help="architecture: a name from megatron_rl.models.spec.MODELS, 'tiny-arith' (the CPU demo), "
                        "or an HF checkpoint directory (see --load-hf)")
    g.add_argument("--num-layers", type=int, help="override the architecture's layer count")
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads (Megatron-LM's pair)")
    g.add_argument("--num-query-groups", type=int, help="key/value heads; needs --group-query-attention")
    g.add_argument("--max-position-embeddings", type=int, help="override the architecture's maximum positions")
    g.add_argument("--kv-channels", type=int, help="head size, when not --hidden-size / --num-attention-heads")
    g.add_argument("--num-experts", type=int,
                   help="a mixture of experts in every layer (a Llama/Mistral becomes Mixtral-style, a Qwen3 "
                        "Qwen3-MoE-style)")
    g.add_argument("--moe-router-topk", type=int, help="experts per token")
    g.add_argument("--moe-ffn-hidden-size", type=int, help="each expert's SwiGLU hidden size")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="weight of the routers' load-balancing loss (Megatron-Core's aux_loss; logged as "
                        "train/moe_aux_loss); 0: none")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="local",
                   help="Megatron-Core layer spec: Megatron's local modules, or Transformer Engine's (GPU; its fused "
                        "norm-linear parameter names are used by HF loading, DDMA and checkpoints)")
    g.add_argument("--seq-length", type=int, default=64, help="max prompt + response tokens")

    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int)
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert parallelism (EP): each EP rank holds num_experts / EP whole experts; EP x expert-TP "
                        "ranks are carved out of the trainer's TP x DP ranks")
    g.add_argument("--expert-tensor-parallel-size", type=int,
                   help="tensor parallelism inside each expert (default: --tensor-model-parallel-size)")
    g.add_argument("--moe-token-dispatcher-type", choices=MOE_TOKEN_DISPATCHERS, default="alltoall",
                   help="how tokens reach their experts' EP ranks (Megatron-Core): alltoall sends each token only "
                        "to the ranks of its experts; allgather gathers every token on every EP rank")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron-Core sequence parallelism over the tensor-parallel group (norms and dropout on "
                        "sequence shards); needs --tensor-model-parallel-size > 1 and Transformer Engine or Apex norms")
    g.add_argument("--distributed-timeout-minutes", type=int, default=30,
                   help="timeout of the run's process groups (a collective waiting this long fails)")
    g.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                   help="where each rank computes: auto = cuda:LOCAL_RANK when CUDA is present, else cpu")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialize the trainer's weights on the CPU, then move them to the GPU (the same weights "
                        "for every TP/PP layout of a seed; always so on a CPU)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=16,
                   help="rollouts per micro-batch, each micro-batch padded to its own longest (without "
                        "--use-dynamic-batch-size)")
    g.add_argument("--use-dynamic-batch-size", action="store_true",
                   help="pack each data-parallel rank's rollouts into micro-batches of at most --max-tokens-per-gpu "
                        "tokens (spread over the ranks balanced by tokens); --micro-batch-size is then unused")
    g.add_argument("--max-tokens-per-gpu", type=int,
                   help="with --use-dynamic-batch-size: tokens per packed training micro-batch (at least "
                        "--seq-length: a rollout is never split; with --sequence-parallel up to TP - 1 more, "
                        "the padding to a multiple of TP)")
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int,
                   help="with --use-dynamic-batch-size: tokens per packed micro-batch of the forward-only log-prob "
                        "passes (reference log-probs); default --max-tokens-per-gpu")
    g.add_argument("--global-batch-size", type=int, default=64,
                   help="rollouts per optimizer step (prompts per step x --n-samples-per-prompt)")
    g.add_argument("--train-iters", type=int, default=40, help="RL optimizer steps")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full", "selective"],
                   help="activation recomputation (Megatron-Core): full = whole layers, selective = core attention")
    g.add_argument("--recompute-method", choices=["uniform", "block"],
                   help="with --recompute-granularity full: which layers (Megatron-LM's meaning)")
    g.add_argument("--recompute-num-layers", type=int, help="layers per recomputed unit (uniform) or per stage (block)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: accumulate and reduce gradients in bf16 (Megatron-LM's flag; default fp32, as "
                        "Megatron-LM does for bf16): half the gradient memory, less precise sums at large DP")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce each bucket of gradients over DP as soon as the last backward has filled it, "
                        "overlapped with the rest of that backward (Megatron's DDP)")
    for flag, field in KERNEL_FUSIONS.items():
        g.add_argument(flag, dest=field, action="store_false",
                       help=f"turn off TransformerConfig's {field} (on by default on GPUs with --transformer-impl "
                            "transformer_engine; the local spec and CPUs run none)")

    g = p.add_argument_group("learning rate and optimizer")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-style", default="constant",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   help="Megatron's schedules over --train-iters; WSD: warmup, stable, then --lr-wsd-decay-iters of "
                        "decay")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["linear", "cosine", "exponential", "minus_sqrt"])
    g.add_argument("--lr-wsd-decay-iters", type=int, help="the decay phase of --lr-decay-style WSD, in steps")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)

    g = p.add_argument_group("supervised warm-up")
    g.add_argument("--sft-warmup-iters", type=int, default=0, help="supervised steps before RL")
    g.add_argument("--sft-lr", type=float, default=3e-3)
    g.add_argument("--sft-lr-warmup-iters", type=int, default=0,
                   help="linear warm-up of the supervised learning rate: step k of the first N runs at --sft-lr x "
                        "k / N")
    g.add_argument("--sft-batch-size", type=int, default=64)
    g.add_argument("--sft-data", metavar="PATH",
                   help="conversations to imitate in the warm-up (JSONL/parquet read like --prompt-data; each a "
                        "message list ending with the assistant's answer); default: the arithmetic task's answers")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--load", help="resume from this megatron-rl checkpoint directory (written by --save). When it "
                                  "holds none yet, a new run starts from --load-hf / --load-megatron, or from the "
                                  "model's initialization when it is also --save: one command for every launch of a "
                                  "job (a requeue resumes it)")
    g.add_argument("--load-hf", help="initial policy weights from an HF checkpoint directory")
    g.add_argument("--ref-load",
                   help="with --kl-coef: the reference policy's weights, an HF checkpoint directory or Megatron "
                        "weights as --load-megatron reads them; default: the policy as RL begins (after any "
                        "--sft-warmup-iters), kept in RL checkpoints")
    g.add_argument("--load-megatron", metavar="DIR",
                   help="initial policy weights (a new run, not a resume) from a Megatron checkpoint: the output of "
                        "tools/convert_hf_to_megatron.py (either format, any TP/PP), one iteration of an RL "
                        "checkpoint, or an RL checkpoint directory (its latest iteration)")
    g.add_argument("--save", help="save checkpoints here")
    g.add_argument("--save-interval", type=int, default=0)
    g.add_argument("--keep-last-n-checkpoints", type=int, metavar="N",
                   help="after each complete save, delete the --save iterations older than the newest N (the one "
                        "the tracker names is always kept; also removes iter_N.partial left by crashed saves); "
                        "default: keep all. HF exports (--save-hf, --save-hf-interval) are outputs and are never "
                        "deleted: bound their number with --save-hf-interval")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal, finish the step, save a checkpoint (with --save) and exit; a requeued job "
                        "with --load = --save resumes from it")
    g.add_argument("--exit-signal", choices=SIGNALS, default="SIGTERM",
                   help="the signal of --exit-signal-handler")
    g.add_argument("--exit-duration-in-mins", type=float, metavar="MIN",
                   help="after the first step past this many minutes, save a checkpoint (with --save) and exit: set "
                        "it below a scheduler's time limit")
    g.add_argument("--save-hf", metavar="DIR",
                   help="write the policy as HF checkpoints DIR/iter_NNNNNNN/ (config, safetensors, tokenizer, "
                        "generation config) at the end of the run and every --save-hf-interval steps "
                        "(default DIR with --save-hf-interval: <output-dir>/hf)")
    g.add_argument("--save-hf-interval", type=int, default=0, help="steps between HF exports (0: only at the end)")

    g = p.add_argument_group("logging")
    g.add_argument("--output-dir", default=os.environ.get("OUTPUT_DIR", "outputs/run"),
                   help="metrics.jsonl, eval.json and plots (env OUTPUT_DIR)")
    g.add_argument("--log-interval", type=int, default=10,
                   help="steps between console lines when the console is not a terminal (metrics files get every "
                        "step)")
    g.add_argument("--wandb-project")
    g.add_argument("--wandb-exp-name")
    g.add_argument("--wandb-save-dir")
    g.add_argument("--wandb-mode", choices=["online", "offline", "disabled"],
                   help="default: WANDB_MODE, else online when WANDB_API_KEY is set, else offline")
    g.add_argument("--tensorboard-dir")
    g.add_argument("--log-param-checksum", action="store_true",
                   help="log a float64 sum of all policy weights after each step (for determinism checks)")

    g = p.add_argument_group("rollout")
    g.add_argument("--rollout-backend", choices=sorted(ENGINE_BACKENDS), default="local",
                   help="local: the built-in engine; sglang: one SGLang server per replica (launched by the "
                        "replica's first generator rank, flags passed through as --sglang-<flag>)")
    g.add_argument("--generator-timeout", type=float, default=900.0,
                   help="stop the run when no generator sends a rollout for this many seconds while prompts are "
                        "in flight (a hung or dead generator rank), instead of waiting for the process-group timeout")
    g.add_argument("--rollout-tensor-parallel-size", type=int, default=1)
    g.add_argument("--rollout-num-replicas", type=int, default=1)
    g.add_argument("--rollout-expert-parallel-size", type=int, default=1,
                   help="SGLang's --ep-size: each generator replica's experts split over this many groups of its "
                        "TP ranks")
    g.add_argument("--rollout-fp8", action="store_true", help="generators serve block-FP8 weights")
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-max-response-len", type=int, default=8)
    g.add_argument("--n-samples-per-prompt", type=int, default=4)
    g.add_argument("--rollout-max-running", type=int, default=None,
                   help="requests decoded together per engine (SGLang's --max-running-requests); default: 64 for "
                        "the built-in engine, SGLang's own choice from its KV cache on a GPU")
    g.add_argument("--rollout-kv-cache-tokens", type=int, default=None,
                   help="KV cache size in tokens per engine (SGLang's --max-total-tokens); default: sized from the "
                        "GPU's memory (--rollout-mem-fraction-static; SGLang: --sglang-mem-fraction-static), and "
                        "on CPUs --rollout-max-running x --seq-length")
    g.add_argument("--rollout-mem-fraction-static", type=float, default=0.8,
                   help="built-in engine on a GPU: the fraction of its memory for weights and KV cache, as "
                        "SGLang's --mem-fraction-static")
    g.add_argument("--rollout-pause-mode", choices=["retract", "in_place"], default="retract",
                   help="what requests in flight do at a weight update (SGLang's pause_generation modes): retract = "
                        "their KV caches are recomputed by the new weights (exact, costs a prefill of everything "
                        "in flight); in_place = they continue on the KV cache the old weights computed (no "
                        "recomputation; the recorded log-probs are still those the tokens were sampled with)")
    g.add_argument("--partial-rollout-max-tokens", type=int, default=None,
                   help="a request yields its slot after this many tokens per weight version and resumes after "
                        "the next update (chunked partial rollouts against stragglers)")

    g = p.add_argument_group("agent rollouts")
    g.add_argument("--rollout-function", choices=list(ROLLOUT_FUNCTIONS), default="single-turn",
                   help="single-turn: one policy call per sample; multi-turn: the built-in tool loop (tools of "
                        "--tool-config called in the Hermes/Qwen <tool_call> format, results in the chat template's "
                        "tool turn, up to --max-turns assistant turns)")
    g.add_argument("--custom-generate-function-path", metavar="FILE.py:FUNCTION | MODULE:FUNCTION",
                   help="your rollout program instead of --rollout-function: `async def generate(sample, client)` "
                        "returning a megatron_rl.rollout.agent.Trajectory; it may call the policy any number of "
                        "times (client.generate: tokens in, tokens out) and use tools")
    g.add_argument("--tool-config", metavar="FILE.json",
                   help="the tools of --rollout-function multi-turn: a JSON list of OpenAI function tools (built-ins "
                        "by name: calculator, python; others with an \"implementation\": FILE.py:FUNCTION); default: "
                        "the calculator and the Python sandbox")
    g.add_argument("--max-turns", type=int, default=4, help="assistant turns per trajectory (multi-turn)")
    g.add_argument("--max-tokens-per-turn", type=int,
                   help="tokens per assistant turn (default: what is left of --rollout-max-response-len, the "
                        "budget of the whole trajectory after its prompt)")
    g.add_argument("--max-observation-len", type=int, default=256,
                   help="a tool result's tokens in its turn; longer ones are truncated, saying so")
    g.add_argument("--tool-timeout", type=float, default=5.0, help="seconds per Python sandbox call")
    g.add_argument("--sandbox-memory-mb", type=int, default=1024, help="the Python sandbox's address space limit")
    g.add_argument("--rollout-program-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="wall-clock limit of one rollout program (one trajectory, its policy calls and tools "
                        "included); past it the sample is excluded with the reason. Must be below "
                        "--generator-timeout")
    g.add_argument("--python-sandbox", choices=PYTHON_SANDBOXES, default="bwrap",
                   help="what contains the python tool's code: bwrap, an OS sandbox from bubblewrap (Linux "
                        "namespaces; the run refuses to start without a working bwrap); weak, a process that "
                        "contains itself (seccomp, rlimits, a Python audit hook): no boundary against hostile code, "
                        "for machines without user namespaces only (docs/agents.md)")
    g.add_argument("--max-consecutive-environment-failures", type=int, default=64,
                   help="stop the run when the environment (a tool's sandbox or server, the rollout program) fails "
                        "on this many trajectories in a row; isolated failures are excluded and counted")

    g = p.add_argument_group("algorithm")
    add_loss_arguments(g)
    g.add_argument("--advantage-estimator", choices=sorted(ADVANTAGE_ESTIMATORS), default="group-baseline")
    g.add_argument("--loss-aggregation", choices=sorted(AGGREGATIONS), default="token-mean")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="weight of the KL divergence to a frozen reference policy (see --ref-load); 0: none")
    g.add_argument("--kl-loss-type", choices=list(KL_ESTIMATORS), default=None,
                   help="the per-token KL estimator, with d = log pi - log ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) + "
                        "d - 1 (GRPO's low-variance one); default k3 as a loss term, k1 with --use-kl-in-reward")
    g.add_argument("--use-kl-in-reward", action="store_true",
                   help="subtract --kl-coef x the KL summed over each response from its reward before the "
                        "advantages (verl's form; the KL of the policy that sampled it) instead of adding the KL "
                        "to the loss")
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--async-mode", choices=["on", "off", "alternate"],
                   help="on (the default): generation overlaps training (off-policy, AIPO-corrected); off: the "
                        "synchronous on-policy baseline; alternate: blocks of --async-alternate-steps asynchronous "
                        "and synchronous steps in turn, to measure the speed-up within one run. --controlled-lag "
                        "implies off")
    g.add_argument("--async-alternate-steps", type=int, default=6, help="steps per block of --async-mode alternate")
    g.add_argument("--max-staleness", type=int,
                   help="max versions between trainer and oldest token (default 1; 0 with --async-mode off, K with "
                        "--controlled-lag K)")
    g.add_argument("--staleness-control", choices=["discard", "admission"], default="discard",
                   help="how --max-staleness is kept. discard (the default): the next step's prompts are dispatched "
                        "ahead and a finished group whose oldest token is too old is dropped, which drops the long "
                        "responses first. admission (AReaL's): at most (max staleness + 1) steps' prompts are in "
                        "flight, and a step trains every group that would be too old at the next one, waiting for "
                        "it: nothing is discarded as stale, at the cost of waiting for the long tail")
    g.add_argument("--controlled-lag", type=int, metavar="K",
                   help="train every batch exactly K weight versions after the one that generated it, to compare "
                        "off-policy corrections at a known lag: each step's prompts are generated synchronously "
                        "under the latest weights and held in a FIFO of K + 1 batches, the oldest trained. The "
                        "first step generates K + 1 batches under the first weights, so steps 1..K train at lags "
                        "0..K-1 (a ramp; each step's rollout/lag_max says its lag), every later one at K. "
                        "Implies --async-mode off; --max-staleness, if given, must be >= K")
    g.add_argument("--max-oversample", type=int, default=4,
                   help="sample up to this many x the step's prompts to replace groups without signal")
    g.add_argument("--max-consecutive-skipped-steps", type=int, default=3,
                   help="stop the run when more optimizer steps than this in a row have a NaN/Inf gradient "
                        "(each is skipped: weights untouched, nothing published)")
    g.add_argument("--keep-uniform-groups", action="store_true",
                   help="train on groups whose rewards are all equal (zero advantage) instead of dropping them")

    g = p.add_argument_group("reward")
    g.add_argument("--reward-fn", default="math",
                   help=f"a registered reward function: {', '.join(sorted(REWARD_FUNCTIONS))}")
    g.add_argument("--custom-rm-path", metavar="FILE.py:FUNCTION | MODULE:FUNCTION",
                   help="your reward function instead of --reward-fn: called with one RewardSample (prompt, "
                        "response, label, metadata, finish_reason), it returns a float, a dict with 'reward', or "
                        "a RewardResult; it runs in the reward worker processes under --reward-timeout")
    g.add_argument("--rm-url", metavar="URL",
                   help="a reward server instead of --reward-fn: each sample is POSTed as JSON (prompt, response, "
                        "label, metadata, finish_reason), the answer is a number or an object with 'reward'; "
                        "--reward-timeout per request")
    g.add_argument("--rm-retries", type=int, default=2,
                   help="--rm-url: tries again after a connection error, a timeout, HTTP 5xx or 429")
    g.add_argument("--rm-max-concurrency", type=int, default=32, help="--rm-url: requests in flight at once")
    g.add_argument("--judge-model", metavar="HF_DIR",
                   help="an LLM judge instead of --reward-fn: this checkpoint, served by an SGLang server of its own "
                        "that the run launches (and restarts), reads each response and gives the verdict")
    g.add_argument("--judge-tensor-parallel-size", type=int, default=1, help="--judge-model: its server's TP size")
    g.add_argument("--judge-base-gpu-id", type=int,
                   help="--judge-model on GPUs: the first of its GPUs on the controller's node, outside the run's "
                        "ranks (required there)")
    g.add_argument("--judge-prompt-template", default=DEFAULT_TEMPLATE,
                   help="--judge-model: what the judge reads, with {prompt}, {response} and {label} (rendered with "
                        "its chat template when it has one)")
    g.add_argument("--judge-verdict-pattern", default=DEFAULT_VERDICT,
                   help="--judge-model: a regular expression; its first group in its last match in the judge's "
                        "answer is the verdict, a number or yes/no, correct/incorrect, true/false, pass/fail")
    g.add_argument("--judge-max-new-tokens", type=int, default=64, help="--judge-model: the longest answer")
    g.add_argument("--judge-max-restarts", type=int, default=3,
                   help="--judge-model: restarts of a dead judge server; past them its samples are scorer failures")
    g.add_argument("--reward-num-workers", type=int, default=2)
    g.add_argument("--reward-timeout", type=int, default=5, help="seconds per verdict (whole seconds)")
    g.add_argument("--max-consecutive-reward-failures", type=int, default=256,
                   help="stop the run when the reward function fails (timeout, crash, bad input) on this many samples "
                        "in a row; isolated failures are excluded from training and counted")
    g.add_argument("--overlong-penalty", action="store_true",
                   help="DAPO's soft overlong punishment: a response longer than --rollout-max-response-len minus "
                        "--overlong-buffer-len loses up to --overlong-penalty-factor, linearly in the excess")
    g.add_argument("--overlong-buffer-len", type=int,
                   help="tokens before the length limit where the overlong penalty grows (default: a quarter of "
                        "--rollout-max-response-len)")
    g.add_argument("--overlong-penalty-factor", type=float, help="the overlong penalty at the limit (default 1.0)")
    g.add_argument("--mask-truncated", action="store_true",
                   help="responses cut off by the length limit keep their reward in their group's baseline but "
                        "carry no gradient (all-false loss mask)")
    g.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="rollout routing replay (R3, mixture-of-experts models): the generator records each token's "
                        "top-k experts in every layer and the trainer's forward passes use exactly those")

    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", "--data-path", dest="prompt_data", metavar="PATH",
                   help="prompt records in a .jsonl/.json (one JSON object per line) or .parquet file: a prompt "
                        "(--input-key; a string or an OpenAI-style message list) and its label (--label-key); "
                        "default: the synthetic arithmetic task")
    g.add_argument("--input-key", default="prompt", help="the records' prompt field")
    g.add_argument("--label-key", default="answer", help="the records' label field (the reference answer, a string)")
    g.add_argument("--metadata-key", help="the records' metadata field (an object), carried with each record")
    g.add_argument("--apply-chat-template", action="store_true",
                   help="render each prompt with the tokenizer's chat template (a string prompt is one user "
                        "message), ending with the assistant's generation prompt; needed for message-list prompts")
    g.add_argument("--system-prompt",
                   help="with --apply-chat-template: a system message put first in every prompt that has none")
    g.add_argument("--task-min-digits", type=int, default=1)
    g.add_argument("--task-max-digits", type=int, default=2)
    g.add_argument("--task-operands", type=int, default=2)
    g.add_argument("--eval-size", type=int, default=200,
                   help="held-out problems of the arithmetic task evaluated (set 'arithmetic'; 0: none)")
    g.add_argument("--eval-prompt-data", nargs="+", metavar="NAME PATH",
                   help="evaluation sets as NAME PATH pairs (files read like --prompt-data), evaluated before RL, "
                        "every --eval-interval steps and at the end; metrics eval/NAME/accuracy")
    g.add_argument("--eval-interval", type=int, default=0, help="RL steps between evaluations (0: before and after "
                                                                 "RL only)")
    g.add_argument("--eval-n-samples", type=int, default=1, help="samples per evaluation prompt (pass@n when > 1)")
    g.add_argument("--eval-temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--eval-max-response-len", type=int, help="default: --rollout-max-response-len")
    g.add_argument("--tokenizer", help="HF tokenizer directory (default: the --load-hf directory; without "
                                       "--load-hf, the character tokenizer)")

    for backend in ENGINE_BACKENDS.values():
        backend.add_arguments(p)

    g = p.add_argument_group("ddma")
    g.add_argument("--ddma-bucket-mb", type=int, default=256)
    g.add_argument("--ddma-debug-checksums", action="store_true")
    return p


# --config NAME: configs/ of this checkout (beside the package), then of the working directory
CONFIG_DIRS = [str(pathlib.Path(__file__).resolve().parents[2] / "configs"), "configs"]


def load_config(name_or_path: str, parser: argparse.ArgumentParser) -> dict:
    candidates = [name_or_path] + [os.path.join(d, name_or_path + ".json") for d in CONFIG_DIRS]
    path = next((c for c in candidates if os.path.isfile(c)), None)
    if path is None:
        parser.error(f"--config {name_or_path!r}: no such file, and no configs/{name_or_path}.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        parser.error(f"--config {path}: invalid JSON ({e})")
    if not isinstance(config, dict):
        parser.error(f"--config {path}: must be a JSON object of flag values, got {type(config).__name__}")
    actions = {a.dest: a for a in parser._actions}
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    unknown = sorted(set(config) - set(actions))
    if unknown:
        parser.error(f"--config {path}: unknown field(s) {unknown} (fields are flag names with '_' for '-')")
    for key, value in config.items():
        problem = _config_value_problem(actions[key], value)
        if problem:
            parser.error(f"--config {path}: field {key!r} {problem}")
    return config


def _config_value_problem(action: argparse.Action, value) -> str | None:
    """Why a JSON value cannot stand for this flag (None if it can): the types argparse would parse."""
    if value is None:
        return None
    values = value if action.nargs in ("+", "*") and isinstance(value, list) else [value]
    for v in values:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            expected = bool
        elif action.type is int:
            expected = int
        elif action.type is float:
            expected = (int, float)
        else:
            expected = str
        if not isinstance(v, expected) or (expected is int and isinstance(v, bool)):
            name = expected.__name__ if isinstance(expected, type) else "float"
            return f"must be {name}, got {type(v).__name__}"
        if action.choices is not None and v not in action.choices:
            return f"must be one of {list(action.choices)}, got {v!r}"
    return None


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**load_config(pre.config, parser))
    args, unknown = parser.parse_known_args(argv)
    args.sglang, rest = collect_server_flags(unknown)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    validate(args, parser)
    return args
