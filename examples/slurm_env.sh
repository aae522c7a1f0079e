#!/usr/bin/env bash
# Sourced by examples/slurm_*.sbatch inside each Slurm task (one task per node): torchrun's multi-node settings
# from Slurm's variables, for examples/launch_common.sh.
#   NNODES      = SLURM_JOB_NUM_NODES (or SLURM_NNODES)
#   NODE_RANK   = SLURM_NODEID (or SLURM_PROCID: with one task per node the two are equal)
#   MASTER_ADDR = the first host of SLURM_JOB_NODELIST (`scontrol show hostnames`, or parsed here without scontrol)
#   MASTER_PORT = 10000 + SLURM_JOB_ID % 50000, so that two jobs on shared hosts do not collide
# Values already in the environment are kept (MASTER_ADDR=..., MASTER_PORT=... override the derivation).

# slurm_launch_env: export NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT from Slurm's variables; an error naming the
# missing variable outside a Slurm job.
slurm_launch_env() {
    local nodelist=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
    if [[ -z "$nodelist" ]]; then
        echo "error: SLURM_JOB_NODELIST is not set: run inside a Slurm job (sbatch examples/slurm_405b_aipo.sbatch)" >&2
        return 2
    fi
    NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}}
    NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-${SLURM_PROCID:-}}}
    if [[ -z "$NNODES" ]]; then
        echo "error: neither SLURM_JOB_NUM_NODES nor SLURM_NNODES is set (the job's node count)" >&2
        return 2
    fi
    if [[ -z "$NODE_RANK" ]]; then
        echo "error: neither SLURM_NODEID nor SLURM_PROCID is set: run the launch under srun, one task per node" >&2
        return 2
    fi
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        MASTER_ADDR=$(first_slurm_host "$nodelist") || return
    fi
    MASTER_PORT=${MASTER_PORT:-$(( 10000 + ${SLURM_JOB_ID:-0} % 50000 ))}
    export NNODES NODE_RANK MASTER_ADDR MASTER_PORT
}

# first_slurm_host NODELIST: the first host of a Slurm node list, by `scontrol show hostnames` where scontrol
# exists, else by expand_first_host.
first_slurm_host() {
    local host
    if command -v scontrol > /dev/null; then
        host=$(scontrol show hostnames "$1" | head -n 1) || host=""
    else
        host=$(expand_first_host "$1")
    fi
    if [[ -z "$host" ]]; then
        echo "error: no host in SLURM_JOB_NODELIST '$1'" >&2
        return 2
    fi
    echo "$host"
}

# expand_first_host NODELIST: the first host of Slurm's compressed list, without scontrol:
# "gpu[007-012,020],cpu3" -> gpu007; "rack[2-3]-n[01-04]" -> rack2-n01; "a1,a2" -> a1 (zero padding kept).
expand_first_host() {
    local list=$1 first="" depth=0 c i
    for (( i = 0; i < ${#list}; i++ )); do  # the first entry: up to a comma outside brackets
        c=${list:i:1}
        [[ $c == "[" ]] && depth=$(( depth + 1 ))
        [[ $c == "]" ]] && depth=$(( depth - 1 ))
        [[ $c == "," && $depth == 0 ]] && break
        first+=$c
    done
    local range
    while [[ $first =~ ^([^[]*)\[([^]]*)\](.*)$ ]]; do  # each bracket: its first number
        range=${BASH_REMATCH[2]%%,*}
        first=${BASH_REMATCH[1]}${range%%-*}${BASH_REMATCH[3]}
    done
    echo "$first"
}
