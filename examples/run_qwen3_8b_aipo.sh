#!/usr/bin/env bash
# Qwen3-8B on 2 nodes x 8 GPUs: trainer TP=2 x DP=4 (8 GPUs, bf16), 8 FP8 generators at TP=1.
#
#   NNODES=2 NODE_RANK=$i MASTER_ADDR=host0 bash examples/run_qwen3_8b_aipo.sh [--flag value ...]
#   bash examples/run_qwen3_8b_aipo.sh --dry-run     # on any machine: rank map, memory per GPU, DDMA estimate
#
# Layout and batch: configs/qwen3-8b.json. Paths from the environment: HF_CHECKPOINT, CHECKPOINT_PATH,
# DATA_PATH, TOKENIZER, OUTPUT_DIR (see examples/launch_common.sh).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

run_aipo qwen3-8b 2 8 "$@"
