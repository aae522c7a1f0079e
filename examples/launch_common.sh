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
