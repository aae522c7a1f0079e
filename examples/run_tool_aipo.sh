#!/usr/bin/env bash
# The tiny Llama learns to use a tool, on a CPU machine: arithmetic with three two-digit operands (26*78+29=?),
# which it cannot do reliably in its head, and a calculator it can call. A short supervised warm-up on tool-use
# demonstrations (the call, then the answer after the tool's result), then asynchronous AIPO with multi-turn
# rollouts (--rollout-function multi-turn): the policy writes a <tool_call>, the calculator's result comes back in
# the chat template's tool turn, the policy answers; only its own tokens are trained. The baseline has the same
# budget without the tool: the same warm-up steps on direct answers, the same RL steps on single-turn rollouts.
# Held-out greedy accuracy on 200 distinct problems never trained on, before and after RL, for both; the tool-call
# rate; a plot of both runs.
#
#   bash examples/run_tool_aipo.sh [--flag value ...]    # extra flags override the ones below (both runs)
#   NO_BASELINE=1 bash examples/run_tool_aipo.sh         # the tool run only
#
# Writes $OUTPUT_DIR/{data/,metrics.jsonl,eval.json,reward_curve.png,no_tool/} (default outputs/tool_aipo).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

OUTPUT_DIR=${OUTPUT_DIR:-outputs/tool_aipo}
GPUS_PER_NODE=${GPUS_PER_NODE:-2}  # processes: 1 trainer rank + 1 generator
NNODES=${NNODES:-1}
MASTER_PORT=${MASTER_PORT:-29515}
single_node_defaults 127.0.0.1
DATA=$OUTPUT_DIR/data

if [[ " $* " != *" --dry-run "* && "$NODE_RANK" == 0 && ! -f "$DATA/tokenizer/tokenizer.json" ]]; then
    "$PYTHON" -m megatron_rl.data.tasks.tool_arithmetic --out "$DATA" --train 4000 --eval 200
fi

MODEL_ARGS=(
    --model tiny-arith --tokenizer "$DATA/tokenizer" --seq-length 128
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --rollout-tensor-parallel-size 1 --rollout-num-replicas 1
)
TRAINING_ARGS=(
    --sft-warmup-iters 240 --sft-lr 1e-3 --sft-lr-warmup-iters 50 --sft-batch-size 64
    --train-iters 60 --global-batch-size 64 --micro-batch-size 32 --lr 5e-4 --lr-decay-style cosine --clip-grad 1.0
    --seed 1234
)
DATA_ARGS=(
    --prompt-data "$DATA/train.jsonl" --input-key messages --label-key answer --apply-chat-template
    --eval-prompt-data heldout "$DATA/eval.jsonl" --eval-interval 20
)
RL_ARGS=(
    --loss aipo --aipo-rho 4 --n-samples-per-prompt 4 --rollout-temperature 0.7 --rollout-max-response-len 64
    --reward-fn math --reward-num-workers 1 --log-interval 5
)
TOOL_ARGS=(
    --sft-data "$DATA/sft_tool.jsonl" --system-prompt "Use the calculator."
    --rollout-function multi-turn --tool-config "$DATA/tools.json" --max-turns 3 --max-tokens-per-turn 48
)
NO_TOOL_ARGS=(
    --sft-data "$DATA/sft_direct.jsonl" --system-prompt "Answer."
)

run() {
    launch "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${RL_ARGS[@]}" \
        --output-dir "$1" "${@:2}"
}

run "$OUTPUT_DIR" "${TOOL_ARGS[@]}" "$@"
[[ " $* " == *" --dry-run "* ]] && exit 0
PLOT_ARGS=("$OUTPUT_DIR" --label "with the calculator")
if [[ "${NO_BASELINE:-0}" != "1" ]]; then
    run "$OUTPUT_DIR/no_tool" "${NO_TOOL_ARGS[@]}" "$@"
    PLOT_ARGS+=(--baseline "$OUTPUT_DIR/no_tool" --baseline-label "without a tool" --plot-only)
fi
# Only node 0 has the controller's files (metrics, evaluations).
if [[ "$NODE_RANK" == 0 ]]; then
    "$PYTHON" -m megatron_rl.observability.plots "${PLOT_ARGS[@]}"
    "$PYTHON" - "$OUTPUT_DIR" <<'EOF'
import json, os, sys
out = sys.argv[1]
for name, run_dir in (("with the calculator", out), ("without a tool", os.path.join(out, "no_tool"))):
    if not os.path.exists(os.path.join(run_dir, "eval.json")):
        continue
    heldout = json.load(open(os.path.join(run_dir, "eval.json")))["eval_sets"]["heldout"]
    steps = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rates = [s["rollout"]["agent_tool_call_rate"] for s in steps  # (None: every trajectory of the step failed)
             if s.get("rollout", {}).get("agent_tool_call_rate") is not None]
    rate = f"; tool-call rate {rates[0]:.2f} at the first RL step, {rates[-1]:.2f} at the last" if rates else ""
    print(f"{name}: held-out accuracy {heldout['before_rl']['accuracy']:.3f} before RL, "
          f"{heldout['after_rl']['accuracy']:.3f} after ({heldout['distinct_problems']} distinct problems){rate}")
EOF
fi
