#!/usr/bin/env bash
# A tiny Llama trained from scratch on the arithmetic task, on a CPU machine, in about 7 minutes on 2 cores:
# a supervised warm-up, then asynchronous AIPO RL with the Megatron-Core trainer (1 process) and one built-in
# generator (1 process), one core each; held-out accuracy on 200 distinct problems before and after RL; a
# reward-curve PNG. Model parallelism: GPUS_PER_NODE=3 bash examples/run_tiny_aipo.sh --tensor-model-parallel-size 2
# (3 processes share the 2 cores: slower here).
#
#   bash examples/run_tiny_aipo.sh [--flag value ...]    # extra flags override the ones below
#   COMPARE_SYNC=1 bash examples/run_tiny_aipo.sh        # also run the synchronous baseline and plot both
#
# Writes $OUTPUT_DIR/{metrics.jsonl,eval.json,reward_curve.png} (default outputs/tiny_aipo).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

OUTPUT_DIR=${OUTPUT_DIR:-outputs/tiny_aipo}
GPUS_PER_NODE=${GPUS_PER_NODE:-2}  # processes: the trainer ranks + 1 generator
NNODES=${NNODES:-1}
MASTER_PORT=${MASTER_PORT:-29511}
single_node_defaults 127.0.0.1  # across nodes NODE_RANK and MASTER_ADDR come from the environment
MODEL_ARGS=(
    --model tiny-arith --seq-length 32
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --rollout-tensor-parallel-size 1 --rollout-num-replicas 1
)
TRAINING_ARGS=(
    --sft-warmup-iters 1500 --sft-lr 1e-3 --sft-lr-warmup-iters 100 --sft-batch-size 64
    --train-iters 500 --global-batch-size 64 --micro-batch-size 32 --lr 1e-4 --lr-decay-style cosine
    --clip-grad 1.0 --seed 1234
)
RL_ARGS=(
    --loss aipo --aipo-rho 4 --advantage-estimator group-baseline  # asynchronous, staleness 1: the defaults
    --n-samples-per-prompt 4 --rollout-temperature 0.7 --rollout-max-response-len 6
    --reward-fn math --reward-num-workers 2
)
DATA_ARGS=(  # operands of 1 or 2 digits, + and -: 20,000 expressions; 200 distinct held-out ones, never trained on
    --task-min-digits 1 --task-max-digits 2 --task-operands 2 --eval-size 200 --eval-interval 50
)

run() {
    launch "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${RL_ARGS[@]}" "${DATA_ARGS[@]}" \
        --output-dir "$1" "${@:2}"
}

run "$OUTPUT_DIR" "$@"
[[ " $* " == *" --dry-run "* ]] && exit 0
PLOT_ARGS=("$OUTPUT_DIR")
if [[ "${COMPARE_SYNC:-0}" == "1" ]]; then
    run "$OUTPUT_DIR/sync" --async-mode off "$@"
    PLOT_ARGS+=(--baseline "$OUTPUT_DIR/sync")
fi
# Only node 0 plots: metrics.jsonl is written by the controller (global rank 0), which runs on node 0.
if [[ "$NODE_RANK" == 0 ]]; then
    "$PYTHON" -m megatron_rl.observability.plots "${PLOT_ARGS[@]}"
fi
