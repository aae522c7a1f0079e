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
# The one-digit task (200 expressions, 15 held out) and the recipe that learns it in about 2 minutes, not the main
# example's two-digit one (about 7 minutes with a dense model; the experts were not tuned for it).
ONE_DIGIT_RECIPE=(
    --task-max-digits 1 --eval-size 15 --sft-warmup-iters 300 --sft-lr 3e-3 --sft-lr-warmup-iters 0
    --lr 5e-4 --lr-decay-style constant --rollout-temperature 1.0 --train-iters 150
)
exec bash "$(dirname "$0")/run_tiny_aipo.sh" --tensor-model-parallel-size 1 --expert-model-parallel-size 2 \
    --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 96 "${ONE_DIGIT_RECIPE[@]}" "$@"
