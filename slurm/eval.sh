#!/usr/bin/env bash
#SBATCH --job-name=dapo-eval
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#
# AIME-style evaluation on one node: avg@32, i.e. 32 samples per problem at temperature 1.0 and
# top-p 0.7 (the DAPO paper's protocol), scored and averaged by tools/eval.py. From the repository root:
#
#   MODEL_PATH=/models/qwen2.5-32b-dapo EVAL_DATA=/data/aime-2024.parquet sbatch slurm/eval.sh [ARGS...]
#   bash slurm/eval.sh --dry-run [ARGS...]    # print the command, run nothing
#
# MODEL_PATH: a Hugging Face directory, a converted Megatron checkpoint, or a training run (its
# newest complete checkpoint): tools/eval.py converts those to Hugging Face under $TMPDIR first, so
# point TMPDIR at scratch space with room for one copy of the model (~65 GB for 32B in bf16).
# ARGS go to tools/eval.py after the flags below, so they win: config overrides (model.dtype=bf16),
# or its other flags (--hf-config DIR, --batch-size N). vLLM runs in this one process with TP
# workers of its own: no torchrun. Works outside Slurm too.
set -euo pipefail

# Settings; the environment wins. Relative paths are taken from REPO_DIR.
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}   # sbatch runs a copy of this file: submit from the repo root
MODEL_PATH=${MODEL_PATH:-}                         # required: the model to evaluate
EVAL_DATA=${EVAL_DATA:-}                           # required: the problems (AIME 2024: parquet or jsonl)
K=${K:-32}                                         # samples per problem
TP=${TP:-8}                                        # vLLM tensor parallel: the node's GPUs
TEMPERATURE=${TEMPERATURE:-1.0}
TOP_P=${TOP_P:-0.7}
EVAL_OUT=${EVAL_OUT:-}                             # per-problem results; default runs/eval/MODEL-DATA-JOB.jsonl
VENV=${VENV:-$REPO_DIR/.venv}

# shellcheck source=slurm/lib.sh
source "$REPO_DIR/slurm/lib.sh" 2>/dev/null ||
    { echo "error: REPO_DIR=$REPO_DIR has no slurm/lib.sh: submit from the repository root or set REPO_DIR" >&2 && exit 2; }

dry_run=0
if dry_run_flag "${BASH_SOURCE[0]}" "${1:-}"; then dry_run=1 && shift; fi
require MODEL_PATH "the model to evaluate: a Hugging Face directory, a Megatron checkpoint or a training run"
require EVAL_DATA "the evaluation problems, e.g. AIME 2024 as jsonl"
[[ $K =~ ^[1-9][0-9]*$ ]] || die "K='$K': expected a positive integer (samples per problem)"
[[ $TP =~ ^[1-9][0-9]*$ ]] || die "TP='$TP': expected a positive integer (vLLM tensor-parallel size)"

[[ -f $REPO_DIR/tools/eval.py ]] || die "REPO_DIR=$REPO_DIR has no tools/eval.py: submit from the repository root or set REPO_DIR"
cd "$REPO_DIR"
MODEL_PATH=$(realpath -m -- "$MODEL_PATH")
EVAL_DATA=$(realpath -m -- "$EVAL_DATA")
[[ -x $VENV/bin/python ]] || die "VENV=$VENV has no bin/python: expected the project's virtualenv (make test creates .venv)"
[[ -d $MODEL_PATH ]] || die "MODEL_PATH=$MODEL_PATH: no such directory"
[[ -f $EVAL_DATA ]] || die "EVAL_DATA=$EVAL_DATA: no such file"
data_name=$(basename "$EVAL_DATA")
EVAL_OUT=$(realpath -m -- "${EVAL_OUT:-runs/eval/$(basename "$MODEL_PATH")-${data_name%.*}-${SLURM_JOB_ID:-local}.jsonl}")

cmd=("$VENV/bin/python" tools/eval.py --model "$MODEL_PATH" --data "$EVAL_DATA" --k "$K"
    --temperature "$TEMPERATURE" --top-p "$TOP_P" --tp "$TP" --out "$EVAL_OUT" "$@")
if ((dry_run)); then
    echo "# run in $(pwd -P) on ${SLURMD_NODENAME:-$(hostname)}:"
    quote "${cmd[@]}"
    exit 0
fi
mkdir -p "$(dirname "$EVAL_OUT")"
echo "[$(date '+%F %T')] job ${SLURM_JOB_ID:-none} on ${SLURMD_NODENAME:-$(hostname)}: $(quote "${cmd[@]}")"
exec "${cmd[@]}"
