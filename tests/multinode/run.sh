#!/usr/bin/env bash
# The multi-node test tier: two "nodes" as two network namespaces on this machine, each running
# examples/run_tiny_aipo.sh under its own torchrun agent (tests/multinode/). Needs root to create the namespaces
# (skipped, with the reason, without it). About 4 minutes on 2 CPU cores (the lost-node resume test 1.5 of
# them). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
exec python -m pytest -q -p no:cacheprovider -rs tests/multinode "$@"
