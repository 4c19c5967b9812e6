#!/usr/bin/env bash
#SBATCH --job-name=dapo-convert
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#
# Checkpoint conversion on one node, before and after training. From the repository root:
#
#   sbatch slurm/convert_checkpoint.sh hf-to-megatron --hf /models/Qwen2.5-32B --out /ckpt/qwen2.5-32b-mcore --tp 8 --pp 2
#   sbatch slurm/convert_checkpoint.sh megatron-to-hf --megatron /ckpt/qwen2.5-32b-mcore --out /models/qwen2.5-32b-dapo
#   bash slurm/convert_checkpoint.sh --dry-run DIRECTION ARGS...    # print the command, run nothing
#
# DIRECTION picks the tool, the other arguments go to it unchanged (`... DIRECTION --help` lists them):
#   hf-to-megatron  tools/convert_hf_to_megatron.py: relaunches itself under torchrun with tp x pp
#                   processes on this node, each reading only its own tensors; on CPU (gloo) when the
#                   node has fewer GPUs than tp x pp, so no GPU is requested. The checkpoint loads into
#                   any training layout; tp/pp only set how the conversion is split.
#   megatron-to-hf  tools/convert_megatron_to_hf.py: one process holding the whole model (~65 GB for
#                   32B in bf16) plus one output shard, hence the whole node's memory (--mem=0).
#                   --megatron takes what hf-to-megatron writes (megatron_dapo.json + model/);
#                   slurm/eval.sh evaluates a training run's checkpoints without this step.
# Add `--gpus-per-node=8` to sbatch to convert on GPUs instead. Works outside Slurm too.
set -euo pipefail

# Settings; the environment wins.
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}   # sbatch runs a copy of this file: submit from the repo root
VENV=${VENV:-$REPO_DIR/.venv}

# shellcheck source=slurm/lib.sh
source "$REPO_DIR/slurm/lib.sh" 2>/dev/null ||
    { echo "error: REPO_DIR=$REPO_DIR has no slurm/lib.sh: submit from the repository root or set REPO_DIR" >&2 && exit 2; }

dry_run=0
if dry_run_flag "${BASH_SOURCE[0]}" "${1:-}"; then dry_run=1 && shift; fi
case ${1:-} in
    hf-to-megatron) tool=tools/convert_hf_to_megatron.py ;;
    megatron-to-hf) tool=tools/convert_megatron_to_hf.py ;;
    "") die "DIRECTION is missing: expected hf-to-megatron or megatron-to-hf, then the tool's arguments" ;;
    *) die "DIRECTION '$1': expected hf-to-megatron or megatron-to-hf" ;;
esac
shift

[[ -f $REPO_DIR/$tool ]] || die "REPO_DIR=$REPO_DIR has no $tool: submit from the repository root or set REPO_DIR"
cd "$REPO_DIR"
[[ -x $VENV/bin/python ]] || die "VENV=$VENV has no bin/python: expected the project's virtualenv (make test creates .venv)"

cmd=("$VENV/bin/python" "$tool" "$@")
if ((dry_run)); then
    echo "# run in $(pwd -P) on ${SLURMD_NODENAME:-$(hostname)}:"
    quote "${cmd[@]}"
    exit 0
fi
echo "[$(date '+%F %T')] job ${SLURM_JOB_ID:-none} on ${SLURMD_NODENAME:-$(hostname)}: $(quote "${cmd[@]}")"
exec "${cmd[@]}"
