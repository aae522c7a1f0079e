#!/usr/bin/env bash
# Llama-3.1 405B on 192 nodes x 8 GPUs, the paper's layout idea: trainer bf16 at TP=8 x PP=16 x DP=8
# (1024 GPUs), 64 FP8 generators at TP=8 (512 GPUs), asynchronous AIPO.
#
#   NNODES=192 NODE_RANK=$i MASTER_ADDR=host0 bash examples/run_405b_aipo.sh [--flag value ...]
#   bash examples/run_405b_aipo.sh --dry-run     # on any machine: rank map, memory per GPU, DDMA estimate
#
# Layout and batch: configs/llama3-405b.json. Paths from the environment: HF_CHECKPOINT, CHECKPOINT_PATH,
# DATA_PATH, TOKENIZER, OUTPUT_DIR (see examples/launch_common.sh).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

run_llama3_aipo 405b 192 64 "$@"
