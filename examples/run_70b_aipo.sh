#!/usr/bin/env bash
# Llama-3.1 70B on 8 nodes x 8 GPUs: trainer TP=8 x PP=4 (32 GPUs, bf16), 8 FP8 generators at TP=4.
#
#   NNODES=8 NODE_RANK=$i MASTER_ADDR=host0 bash examples/run_70b_aipo.sh [--flag value ...]
#   bash examples/run_70b_aipo.sh --dry-run     # on any machine: rank map, memory per GPU, DDMA estimate
#
# Layout and batch: configs/llama3-70b.json. Paths from the environment: HF_CHECKPOINT, CHECKPOINT_PATH,
# DATA_PATH, TOKENIZER, OUTPUT_DIR (see examples/launch_common.sh).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

run_llama3_aipo 70b 8 8 "$@"
