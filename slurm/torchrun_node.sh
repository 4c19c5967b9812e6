#!/usr/bin/env bash
# Per-node launcher: srun runs one copy on every node of a job (one task per node). It adds the
# torchrun options that differ between nodes and execs torchrun.
#
#   torchrun_node.sh [--print] LOG_DIR TORCHRUN [TORCHRUN_ARGS...]
#
# LOG_DIR: torchrun's per-rank logs go to LOG_DIR/node$SLURM_NODEID. --print writes the command,
# as one line a shell reads back word for word, instead of running it (the batch scripts' --dry-run calls it once per node).
set -euo pipefail

print=0
if [[ ${1:-} == --print ]]; then
    print=1
    shift
fi
if (($# < 2)); then
    echo "error: usage: torchrun_node.sh [--print] LOG_DIR TORCHRUN [TORCHRUN_ARGS...]" >&2
    exit 2
fi
if [[ ! ${SLURM_NODEID:-} =~ ^[0-9]+$ ]]; then
    echo "error: SLURM_NODEID='${SLURM_NODEID:-}': expected this node's index in the job (srun sets it)" >&2
    exit 2
fi
# shellcheck source=slurm/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

log_dir=$1
torchrun=$2
shift 2

# Node 0 is the first host of SLURM_JOB_NODELIST, where the batch script points --rdzv-endpoint:
# saying who hosts the store replaces torchrun's hostname matching (and fails fast if the port is
# taken); read_timeout=300 lets the other nodes wait for a head node that starts slowly.
cmd=("$torchrun" "--rdzv-conf=is_host=$((SLURM_NODEID == 0)),read_timeout=300"
    "--log-dir=$log_dir/node$SLURM_NODEID" "$@")

if ((print)); then
    quote "${cmd[@]}"
else
    # beside torchrun, until it ends: a process of this node that stops running is woken for its stacks and killed
    # (megatron_dapo/launch/watchdog.py; a process that still runs finds the stall itself)
    if [[ -n ${DAPO_LOG_DIR:-} ]]; then
        "$(dirname "$torchrun")/python" -m megatron_dapo.launch.watchdog --node "$DAPO_LOG_DIR" &
    fi
    exec "${cmd[@]}"
fi
