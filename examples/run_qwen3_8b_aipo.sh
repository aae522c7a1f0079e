#!/usr/bin/env bash
# Qwen3-8B on one node of 8 GPUs: trainer TP=2 x DP=2 (4 GPUs, bf16), 4 FP8 generator replicas at TP=1 (a GPU each).
# On two nodes (NNODES=2, 16 GPUs) the same layout doubles: trainer TP=2 x DP=4, 8 replicas.
#
#   bash examples/run_qwen3_8b_aipo.sh [--flag value ...]                                   # one node
#   NNODES=2 NODE_RANK=$i MASTER_ADDR=host0 bash examples/run_qwen3_8b_aipo.sh [--flag ...]  # each of two nodes
#   bash examples/run_qwen3_8b_aipo.sh --dry-run     # on any machine: rank map, memory per GPU, DDMA estimate
#
# Layout and batch: configs/qwen3-8b.json. Paths from the environment: HF_CHECKPOINT, CHECKPOINT_PATH,
# DATA_PATH, TOKENIZER, OUTPUT_DIR (see examples/launch_common.sh).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

NNODES=${NNODES:-1}
run_aipo qwen3-8b "$NNODES" $(( NNODES * ${GPUS_PER_NODE:-8} / 2 )) "$@"
