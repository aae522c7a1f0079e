#!/usr/bin/env bash
# Shared by the run_*_aipo.sh scripts: launch megatron_rl.train with torchrun across NNODES nodes, or, with
# --dry-run among the arguments, plan the whole launch on this machine without GPUs or weights.
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE: torchrun's multi-node settings (env).
launch() {
    local world=$(( NNODES * GPUS_PER_NODE ))
    if [[ " $* " == *" --dry-run "* ]]; then
        python -m megatron_rl.train "$@" --world-size "$world"
    else
        torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" -m megatron_rl.train "$@"
    fi
}

# run_llama3_aipo SIZE NODES REPLICAS [flags...]: the Llama-3.1 AIPO job of examples/run_{8b,70b,405b}_aipo.sh.
# Layout, batch sizes and FP8 come from configs/llama3-SIZE.json; paths from the environment: HF_CHECKPOINT
# (initial policy, HF format), CHECKPOINT_PATH (save/resume), DATA_PATH (JSONL prompts with answers),
# TOKENIZER (HF tokenizer directory), OUTPUT_DIR. Extra flags override everything.
run_llama3_aipo() {
    local size=$1 nodes=$2 replicas=$3
    shift 3
    NNODES=${NNODES:-$nodes}
    NODE_RANK=${NODE_RANK:-0}
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}
    MASTER_ADDR=${MASTER_ADDR:-localhost}
    MASTER_PORT=${MASTER_PORT:-6000}
    local hf=${HF_CHECKPOINT:-/checkpoints/llama3-$size-hf}
    local ckpt=${CHECKPOINT_PATH:-/checkpoints/llama3-$size-aipo}
    local data=${DATA_PATH:-/data/math/train.jsonl}
    local tokenizer=${TOKENIZER:-$hf}
    local out=${OUTPUT_DIR:-outputs/llama3_${size}_aipo}

    local model_and_layout_args=(--config "llama3-$size" --rollout-num-replicas "$replicas")
    local checkpoint_args=(--load-hf "$hf" --save "$ckpt" --save-interval 20)
    local data_args=(--data-path "$data" --tokenizer "$tokenizer" --reward-fn math --reward-num-workers 16)
    local rl_args=(--loss aipo --async-mode on --advantage-estimator group-baseline --train-iters 500
                   --rollout-temperature 1.0 --rollout-top-p 1.0)
    local logging_args=(--output-dir "$out" --wandb-project megatron-rl --wandb-exp-name "llama3-$size-aipo"
                        --tensorboard-dir "$out/tensorboard")
    launch "${model_and_layout_args[@]}" "${checkpoint_args[@]}" "${data_args[@]}" "${rl_args[@]}" \
        "${logging_args[@]}" "$@"
}
