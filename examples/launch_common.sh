#!/usr/bin/env bash
# Shared by the run_*_aipo.sh scripts: launch megatron_rl.train with torchrun across NNODES nodes, or, with
# --dry-run among the arguments, plan the whole launch on this machine without GPUs or weights.
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE: torchrun's multi-node settings (env); every node
#   runs the same script with its own NODE_RANK and node 0's address as MASTER_ADDR. On more than one node gloo
#   (the sync group) and NCCL pick their network interface from GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME; where
#   GLOO_SOCKET_IFNAME is unset it is set to the interface this node reaches MASTER_ADDR by (without it gloo may
#   advertise 127.0.0.1 to the other nodes).
# A node waits for the others at most --distributed-timeout-minutes (default 30): torchrun's rendezvous gets
# that timeout, and the run's process groups and channels use it too.
# PYTHON: the interpreter that has torch and megatron-rl (default python3); torchrun is run as its module.
PYTHON=${PYTHON:-python3}

launch() {
    local world=$(( NNODES * GPUS_PER_NODE ))
    if [[ " $* " == *" --dry-run "* ]]; then
        "$PYTHON" -m megatron_rl.train "$@" --world-size "$world"
    else
        check_node_env || return
        if (( NNODES > 1 )) && [[ -z "${GLOO_SOCKET_IFNAME:-}" ]]; then
            GLOO_SOCKET_IFNAME=$(interface_to "$MASTER_ADDR")
            [[ -n "$GLOO_SOCKET_IFNAME" ]] && export GLOO_SOCKET_IFNAME \
                && echo "[launch] GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME (this node's interface to MASTER_ADDR $MASTER_ADDR)"
        fi
        local timeout_s
        timeout_s=$(rendezvous_timeout_s "$@") || return
        # a signal to torchrun (a scheduler's, --exit-signal-handler) leaves the workers this long to save and exit
        export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}
        "$PYTHON" -m torch.distributed.run --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --rdzv-conf "timeout=$timeout_s" \
            -m megatron_rl.train "$@"
    fi
}

# check_node_env: NNODES, NODE_RANK, GPUS_PER_NODE and MASTER_PORT are whole numbers, NODE_RANK < NNODES, and a
# launch across nodes names node 0's address (a default of localhost would make every node wait for itself).
check_node_env() {
    local name
    for name in NNODES NODE_RANK GPUS_PER_NODE MASTER_PORT; do
        if [[ -z "${!name:-}" ]]; then
            echo "error: $name is not set (NNODES=${NNODES:-}; across nodes each node sets its own NODE_RANK)" >&2
            return 2
        elif [[ ! "${!name}" =~ ^[0-9]+$ ]]; then
            echo "error: $name must be a whole number, got '${!name}'" >&2
            return 2
        fi
    done
    if (( NNODES < 1 || NODE_RANK >= NNODES )); then
        echo "error: NODE_RANK must be in [0, NNODES): got NODE_RANK=$NODE_RANK, NNODES=$NNODES" >&2
        return 2
    fi
    if (( NNODES > 1 )) && [[ -z "${MASTER_ADDR:-}" ]]; then
        echo "error: MASTER_ADDR must be node 0's address when NNODES=$NNODES > 1" >&2
        return 2
    fi
}

# interface_to HOST: the network interface this node reaches HOST by (on HOST itself, the one holding its address);
# empty where `ip` is missing or HOST does not resolve.
interface_to() {
    command -v ip > /dev/null || return 0
    local addr
    addr=$(getent ahostsv4 "$1" 2> /dev/null | awk 'NR == 1 {print $1}')
    [[ -n "$addr" ]] || return 0
    local local_if
    local_if=$(ip -o -4 addr show to "$addr" 2> /dev/null | awk '{print $2; exit}')
    if [[ -n "$local_if" ]]; then
        echo "$local_if"
    else
        ip -o route get "$addr" 2> /dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p'
    fi
}

# single_node_defaults ADDR: on one node (NNODES=1) NODE_RANK defaults to 0 and MASTER_ADDR to ADDR. Across nodes
# both come from the environment (each node its own NODE_RANK, all of them node 0's address): a default there would
# make a node that was not given them wait for a rendezvous of its own.
single_node_defaults() {
    if [[ "${NNODES:-}" == 1 ]]; then
        NODE_RANK=${NODE_RANK:-0}
        MASTER_ADDR=${MASTER_ADDR:-$1}
    fi
}

# rendezvous_timeout_s [flags...]: seconds torchrun's rendezvous waits for node 0's store on each of its two
# connection attempts (torch's TCPStore retries once after a random delay): half the flags'
# --distributed-timeout-minutes (the last one given, as argparse takes it; default 30), so that a node whose node 0
# never came up gives up within that time.
rendezvous_timeout_s() {
    local minutes=30 flag
    while (( $# )); do
        flag=$1
        shift
        case $flag in
            --distributed-timeout-minutes) minutes=${1-}; shift $(( $# > 0 )) ;;
            --distributed-timeout-minutes=*) minutes=${flag#*=} ;;
        esac
    done
    if [[ ! "$minutes" =~ ^[0-9]+$ ]] || (( minutes < 1 )); then
        echo "error: --distributed-timeout-minutes must be a whole number of minutes >= 1, got '$minutes'" >&2
        return 2
    fi
    echo $(( minutes * 30 ))
}

# run_llama3_aipo SIZE NODES REPLICAS [flags...]: the Llama-3.1 AIPO job of examples/run_{8b,70b,405b}_aipo.sh,
# configs/llama3-SIZE.json (see run_aipo).
run_llama3_aipo() {
    local size=$1
    shift
    run_aipo "llama3-$size" "$@"
}

# run_aipo CONFIG NODES REPLICAS [flags...]: the AIPO job of the examples/run_*_aipo.sh scripts on NODES nodes
# (NNODES overrides) with REPLICAS generator replicas. Layout, batch sizes and FP8 come from configs/CONFIG.json;
# paths from the environment: HF_CHECKPOINT (initial policy, HF format), CHECKPOINT_PATH (save/resume), DATA_PATH
# (JSONL prompts with answers), TOKENIZER (HF tokenizer directory), OUTPUT_DIR. Extra flags override everything.
run_aipo() {
    local config=$1 nodes=$2 replicas=$3
    shift 3
    NNODES=${NNODES:-$nodes}
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}
    MASTER_PORT=${MASTER_PORT:-6000}
    single_node_defaults localhost
    local hf=${HF_CHECKPOINT:-/checkpoints/$config-hf}
    local ckpt=${CHECKPOINT_PATH:-/checkpoints/$config-aipo}
    local data=${DATA_PATH:-/data/math/train.jsonl}
    local tokenizer=${TOKENIZER:-$hf}
    local name=${config//[-.]/_}
    local out=${OUTPUT_DIR:-outputs/${name}_aipo}

    local model_and_layout_args=(--config "$config" --rollout-num-replicas "$replicas")
    # --load = --save: a requeued or resubmitted job resumes from its latest checkpoint, a new one starts from $hf
    local checkpoint_args=(--load-hf "$hf" --save "$ckpt" --load "$ckpt" --save-interval 20 --exit-signal-handler)
    local data_args=(--prompt-data "$data" --tokenizer "$tokenizer" --reward-fn math --reward-num-workers 16)
    local rl_args=(--loss aipo --async-mode on --advantage-estimator group-baseline --train-iters 500
                   --rollout-temperature 1.0 --rollout-top-p 1.0)
    local logging_args=(--output-dir "$out" --wandb-project megatron-rl --wandb-exp-name "$config-aipo"
                        --tensorboard-dir "$out/tensorboard")
    launch "${model_and_layout_args[@]}" "${checkpoint_args[@]}" "${data_args[@]}" "${rl_args[@]}" \
        "${logging_args[@]}" "$@"
}
