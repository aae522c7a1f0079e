#!/usr/bin/env bash
# A user's path on a CPU machine, end to end: a chat dataset in OpenAI message format (arithmetic and fraction
# word problems the project makes, reference answers partly in LaTeX) and a BPE tokenizer with a chat template
# (trained here with the `tokenizers` library, saved in HF form); a tiny Llama from scratch with that vocabulary;
# a supervised warm-up on worked answers, then asynchronous AIPO with --apply-chat-template, the math reward on
# \boxed{} answers, a KL penalty to the policy RL started from, and a held-out evaluation set; the policy exported
# to HF at the end, loaded with `transformers`, and its held-out accuracy checked against the run's own.
#
#   bash examples/run_math_chat.sh [--flag value ...]    # extra flags override the ones below
#
# Writes $OUTPUT_DIR/{data/,metrics.jsonl,eval.json,reward_curve.png,hf/iter_NNNNNNN/} (default outputs/math_chat).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

OUTPUT_DIR=${OUTPUT_DIR:-outputs/math_chat}
GPUS_PER_NODE=${GPUS_PER_NODE:-3}  # processes: 2 trainer ranks + 1 generator
NNODES=${NNODES:-1}
MASTER_PORT=${MASTER_PORT:-29513}
single_node_defaults 127.0.0.1
DATA=$OUTPUT_DIR/data
SYSTEM_PROMPT='Solve the problem. Put the final answer in \boxed{}.'
MAX_RESPONSE=16

if [[ " $* " != *" --dry-run "* && "$NODE_RANK" == 0 && ! -f "$DATA/tokenizer/tokenizer.json" ]]; then
    "$PYTHON" -m megatron_rl.data.tasks.word_problems --out "$DATA" --train 4000 --eval 200
fi

MODEL_ARGS=(
    --model tiny-arith --tokenizer "$DATA/tokenizer" --seq-length 80
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
    --rollout-tensor-parallel-size 1 --rollout-num-replicas 1
)
TRAINING_ARGS=(
    --sft-warmup-iters 300 --sft-lr 3e-3 --sft-batch-size 64 --sft-data "$DATA/sft.jsonl"
    --train-iters 60 --global-batch-size 64 --micro-batch-size 32 --lr 5e-4 --clip-grad 1.0 --seed 1234
)
DATA_ARGS=(
    --prompt-data "$DATA/train.jsonl" --input-key messages --label-key answer
    --apply-chat-template --system-prompt "$SYSTEM_PROMPT"
    --eval-prompt-data heldout "$DATA/eval.jsonl" --eval-interval 20
)
RL_ARGS=(
    --loss aipo --aipo-rho 4 --async-mode on --max-staleness 1 --n-samples-per-prompt 4
    --rollout-temperature 1.0 --rollout-max-response-len "$MAX_RESPONSE"
    --reward-fn math --reward-num-workers 2 --kl-coef 0.01 --kl-loss-type k3
)

launch "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${RL_ARGS[@]}" \
    --output-dir "$OUTPUT_DIR" --save-hf "$OUTPUT_DIR/hf" "$@"
[[ " $* " == *" --dry-run "* ]] && exit 0
# Only node 0 has the controller's files (metrics, evaluations, the HF export).
if [[ "$NODE_RANK" == 0 ]]; then
    "$PYTHON" -m megatron_rl.observability.plots "$OUTPUT_DIR"
    EXPORT=$(ls -d "$OUTPUT_DIR"/hf/iter_* | sort | tail -1)
    "$PYTHON" "$(dirname "$0")/../tools/eval_hf.py" --hf-dir "$EXPORT" --eval-prompt-data "$DATA/eval.jsonl" \
        --input-key messages --label-key answer --apply-chat-template --system-prompt "$SYSTEM_PROMPT" \
        --max-new-tokens "$MAX_RESPONSE" --compare-eval-json "$OUTPUT_DIR/eval.json" --eval-set heldout
fi
