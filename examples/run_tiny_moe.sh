#!/usr/bin/env bash
# The tiny example (examples/run_tiny_aipo.sh) as a mixture of experts, on a CPU machine: a Mixtral-style model
# (4 experts, top-2, in every layer) trained from scratch, its experts split over the 2 trainer ranks (expert
# parallelism, EP=2) and served whole by one built-in generator; DDMA sends each trainer rank's experts.
#
#   bash examples/run_tiny_moe.sh [--flag value ...]
#   bash examples/run_tiny_moe.sh --use-rollout-routing-replay    # R3: the trainer replays the generator's routes
#
# Writes $OUTPUT_DIR/{metrics.jsonl,eval.json,reward_curve.png} (default outputs/tiny_moe).
set -euo pipefail
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/tiny_moe}
export GPUS_PER_NODE=${GPUS_PER_NODE:-3}  # processes: 2 trainer ranks (EP=2) + 1 generator
exec bash "$(dirname "$0")/run_tiny_aipo.sh" --tensor-model-parallel-size 1 --expert-model-parallel-size 2 \
    --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 96 "$@"
