#!/usr/bin/env bash
# A rollout program of your own on chat data, on a CPU machine: examples/chat_program.py (the policy answers, is
# asked to check its answer, answers again) on run_math_chat.sh's word problems, a chat dataset in OpenAI message
# format with a BPE tokenizer and its chat template. A supervised warm-up on worked answers, then asynchronous
# AIPO on the program's two-turn trajectories (--custom-generate-function-path), the math reward on the last
# answer's \boxed{}; a held-out set through the same program. Needs the `openai` client (pip install openai).
#
#   bash examples/run_chat_program.sh [--flag value ...]    # extra flags override the ones below
#
# Writes $OUTPUT_DIR/{data/,metrics.jsonl,rollouts.jsonl,eval.json,reward_curve.png} (default outputs/chat_program)
# and prints the run's accounting (every sample trained on or excluded with its reason: the ledger's figures).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

OUTPUT_DIR=${OUTPUT_DIR:-outputs/chat_program}
GPUS_PER_NODE=${GPUS_PER_NODE:-2}  # processes: 1 trainer rank + 1 generator
NNODES=${NNODES:-1}
MASTER_PORT=${MASTER_PORT:-29517}
single_node_defaults 127.0.0.1
DATA=$OUTPUT_DIR/data

if [[ " $* " != *" --dry-run "* && "$NODE_RANK" == 0 && ! -f "$DATA/tokenizer/tokenizer.json" ]]; then
    python -m megatron_rl.data.tasks.word_problems --out "$DATA" --train 4000 --eval 200
fi

MODEL_ARGS=(
    --model tiny-arith --tokenizer "$DATA/tokenizer" --seq-length 160
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --rollout-tensor-parallel-size 1 --rollout-num-replicas 1
)
TRAINING_ARGS=(
    --sft-warmup-iters 300 --sft-lr 3e-3 --sft-batch-size 64 --sft-data "$DATA/sft.jsonl"
    --train-iters 60 --global-batch-size 64 --micro-batch-size 32 --lr 5e-4 --clip-grad 1.0 --seed 1234
)
DATA_ARGS=(
    --prompt-data "$DATA/train.jsonl" --input-key messages --label-key answer --apply-chat-template
    --eval-prompt-data heldout "$DATA/eval.jsonl" --eval-interval 20
)
# the program's budget: two answers of at most 16 tokens (chat_program.ANSWER_TOKENS) and the check request
RL_ARGS=(
    --loss aipo --aipo-rho 4 --n-samples-per-prompt 4 --rollout-temperature 1.0 --rollout-max-response-len 64
    --reward-fn math --reward-num-workers 1
    --custom-generate-function-path "$(dirname "$0")/chat_program.py:generate" --rollout-program-timeout 120
)

launch "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${RL_ARGS[@]}" \
    --output-dir "$OUTPUT_DIR" "$@"
[[ " $* " == *" --dry-run "* ]] && exit 0
# Only node 0 has the controller's files (metrics, evaluations, the ledger).
if [[ "$NODE_RANK" == 0 ]]; then
    python -m megatron_rl.observability.plots "$OUTPUT_DIR"
    python -m megatron_rl.observability.accounting "$OUTPUT_DIR"
fi
