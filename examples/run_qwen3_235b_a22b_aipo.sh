#!/usr/bin/env bash
# Qwen3-235B-A22B (94 layers, 128 experts, 8 per token) on 40 nodes x 8 GPUs: trainer bf16 at TP=4 x PP=8 x DP=8
# (256 GPUs; stages of 11 + 12 x 6 + 11 layers) with expert parallelism EP=16 (8 experts per GPU, ETP=1), 8 FP8
# generators at TP=8 with EP=8 (64 GPUs, 16 whole experts per GPU), asynchronous AIPO.
#
#   NNODES=40 NODE_RANK=$i MASTER_ADDR=host0 bash examples/run_qwen3_235b_a22b_aipo.sh [--flag value ...]
#   bash examples/run_qwen3_235b_a22b_aipo.sh --dry-run   # on any machine: rank map with EP, memory per GPU, DDMA
#
# Layout and batch: configs/qwen3-235b-a22b.json (why this layout: its _comment). Paths from the environment:
# HF_CHECKPOINT, CHECKPOINT_PATH, DATA_PATH, TOKENIZER, OUTPUT_DIR (see examples/launch_common.sh).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

run_aipo qwen3-235b-a22b 40 8 "$@"
