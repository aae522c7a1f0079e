#!/usr/bin/env bash
# Llama-3.1 405B on 192 nodes x 8 GPUs, the paper's layout idea: trainer bf16 at TP=8 x PP=16 x DP=8
# (1024 GPUs), 64 FP8 generators at TP=8 (512 GPUs), asynchronous AIPO.
#
#   NNODES=192 NODE_RANK=$i MASTER_ADDR=host0 bash examples/run_405b_aipo.sh [--flag value ...]
#   bash examples/run_405b_aipo.sh --dry-run     # on any machine: rank map, memory per GPU, DDMA estimate
#
# Paths come from the environment: HF_CHECKPOINT (initial policy, HF format), CHECKPOINT_PATH (save/resume),
# DATA_PATH (JSONL prompts with answers), TOKENIZER (HF tokenizer directory).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

NNODES=${NNODES:-192}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
HF_CHECKPOINT=${HF_CHECKPOINT:-/checkpoints/llama3-405b-hf}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-/checkpoints/llama3-405b-aipo}
DATA_PATH=${DATA_PATH:-/data/math/train.jsonl}
TOKENIZER=${TOKENIZER:-$HF_CHECKPOINT}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/llama3_405b_aipo}

MODEL_AND_LAYOUT_ARGS=(
    --config llama3-405b            # configs/llama3-405b.json: architecture, TP/PP, batch sizes, FP8
    --rollout-num-replicas 64
)
CHECKPOINT_ARGS=(
    --load-hf "$HF_CHECKPOINT" --save "$CHECKPOINT_PATH" --save-interval 20
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --tokenizer "$TOKENIZER" --reward-fn math --reward-num-workers 16
)
RL_ARGS=(
    --loss aipo --async-mode on --advantage-estimator group-baseline --train-iters 500
    --rollout-temperature 1.0 --rollout-top-p 1.0
)
LOGGING_ARGS=(
    --output-dir "$OUTPUT_DIR" --wandb-project megatron-rl --wandb-exp-name llama3-405b-aipo
    --tensorboard-dir "$OUTPUT_DIR/tensorboard"
)

launch "${MODEL_AND_LAYOUT_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${DATA_ARGS[@]}" "${RL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
