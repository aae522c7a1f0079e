#!/usr/bin/env bash
# Qwen3-30B-A3B (128 experts, 8 per token) on 4 nodes x 8 GPUs: trainer TP=4 x DP=4 (16 GPUs, bf16) with expert
# parallelism EP=8 (16 experts per GPU, ETP=1), 8 FP8 generators at TP=2 with EP=2 (64 whole experts per GPU).
#
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=host0 bash examples/run_qwen3_30b_a3b_aipo.sh [--flag value ...]
#   bash examples/run_qwen3_30b_a3b_aipo.sh --dry-run   # on any machine: rank map with EP, memory per GPU, DDMA
#
# Layout and batch: configs/qwen3-30b-a3b.json. Paths from the environment: HF_CHECKPOINT, CHECKPOINT_PATH,
# DATA_PATH, TOKENIZER, OUTPUT_DIR (see examples/launch_common.sh).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

run_aipo qwen3-30b-a3b 4 8 "$@"
