#!/usr/bin/env bash
#SBATCH --job-name=dapo-qwen32b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@2400
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#
# DAPO on Qwen2.5-32B base with DAPO-Math-17K: the paper's run (Yu et al. 2025). From the
# repository root:
#
#   MODEL_PATH=/ckpt/qwen2.5-32b-mcore DATA_PATH=/data/dapo-math-17k.parquet VAL_PATH=/data/aime-2024.parquet \
#       RUN_DIR=/scratch/dapo-32b sbatch [-p PARTITION -A ACCOUNT] slurm/train_qwen32b.sh [dotted.override=value ...]
#   bash slurm/train_qwen32b.sh --dry-run [overrides]   # in an allocation, or with SLURM_* set by
#                                                      # hand: print every node's command, run nothing
#
# Each node runs `torchrun ... -m megatron_dapo.train --config examples/dapo_math_qwen2.5_32b.yaml
# trainer.run_dir=RUN_DIR model.hf_path=MODEL_PATH data.train_files=[DATA_PATH]
# data.val_files=[VAL_PATH] [overrides]` (VAL_PATH=none: eval.every=0 instead, no AIME evaluation).
# The run: 512 prompts x 16 responses per step, responses up to 20480 tokens = 16384 + a 4096-token
# soft overlong buffer, clip eps 0.2 / 0.28, AdamW lr 1e-6 warmed up over 20 rollout steps, no KL term.
#
# Layout (set in the YAML): 16 nodes x 8 GPUs = 128. parallel.tp=8 keeps tensor parallelism inside
# a node (NVLink); parallel.pp=2 splits the 64 layers across two nodes; cp=1; data parallel
# = 128 / (8 x 2) = 8. rollout.tp=8: one vLLM engine per node (16 engines), each generating its share.
#
# Asynchronous DAPO (docs/async.md, docs/slurm.md): ROLLOUT_NODES=R runs the engines and the rollout
# controller on the first R nodes and Megatron on the rest, as two srun steps of one torchrun per node
# (pipeline.mode=async pipeline.rollout_gpus=R x GPUS_PER_NODE; they meet at the first node's TRANSPORT_PORT
# and the next port); signals go to the train step, which saves and stops the controller. 0: colocated.
#
# Why it fits 80 GB GPUs (estimates; Qwen2.5-32B has ~32.8B parameters, 1/16 of them per GPU):
#   weights bf16 4.1 GB + gradient buffer fp32 8.2 GB + master weights and Adam moments (12 B per
#   parameter) sharded over the 8 data-parallel ranks by the distributed optimizer 3.1 GB = ~15 GB
#   that stays resident. vLLM lives in the same processes and sleeps while Megatron trains (KV
#   cache freed, weights offloaded or dropped), so training gets the rest; while vLLM generates, Megatron's
#   activations are gone and vLLM's share holds its TP-8 weights (8.2 GB) and the KV cache (32 KiB
#   per token per GPU). PP=2 halves the resident part (PP=1: ~27 GB), which is what leaves vLLM room.
#   A 20k-token micro-batch keeps ~0.5 GB of activations per layer without recompute, ~15 GB per
#   micro-batch in flight on 32 layers (1F1B holds up to two); model.recompute=full keeps only each
#   layer's input (~1 GB) and recomputes the rest in the backward pass.
#   Longer responses: parallel.cp=2 splits every sequence over two GPUs (data parallel drops to 4);
#   context parallelism needs Transformer Engine.
#
# Time limit, preemption, requeue: the run saves and resumes by itself.
#   1. --signal=B:USR1@2400: 40 min before the time limit Slurm sends SIGUSR1 to this batch shell
#      only ("B:"), not to the job step.
#   2. The shell's trap forwards it once to srun, which forwards it to its tasks: slurmstepd
#      signals every process of the step on every node (proctrack/cgroup; with proctrack/pgid only
#      the task itself, torchrun).
#   3. torchrun must neither die of it (SIGUSR1's default action kills the agent, and the step's
#      workers with it) nor kill the workers while they save. --signals-to-handle adds SIGUSR1 to
#      the signals the agent catches; it then sends the signal to each worker's process group and
#      waits --shutdown-timeout seconds before SIGKILL. That timeout defaults to 30 s (or
#      TORCH_ELASTIC_SHUTDOWN_TIMEOUT), far less than a 32B step plus a save: SAVE_GRACE_S sets it.
#   4. megatron_dapo.train catches SIGUSR1/SIGTERM: every rank finishes the step in flight, they
#      agree to stop (all-reduce), save run_dir/checkpoints/step_N, and exit 0. torchrun still
#      exits 1 (it re-raises the signal), so the decision below does not read its status.
#   5. After srun: run_dir/FINISHED (written at trainer.total_steps) -> done, exit 0. SIGUSR1 came
#      and checkpoints/latest moved during this job -> `scontrol requeue`: the job goes back to the
#      queue under the same id and the next attempt resumes from latest (it passes trainer.resume=true).
#      SIGUSR1 but no new checkpoint -> exit 1, no requeue (another attempt could make no more progress).
#      A stall (the run's watchdog found a process that stopped making progress; LOG_DIR/JOB_ID/attempt_N/
#      stall.json) -> requeued from latest up to trainer.stall_requeues times in this job, then exit 75.
#      No stop signal -> a failure: exit non-zero, never requeued.
#   Lead time: 40 min must cover the rest of the step in flight plus the save. tools/estimate_step_time.py
#   with assumed H100 rates gives 6-11 min per step at mean response lengths of 1k-5k tokens; a step
#   that needs 3 generation rounds, each as long as one 20k-token response decoding alone, reaches
#   ~25 min. The save writes ~460 GB (bf16 weights, fp32 master weights and Adam moments): minutes
#   on a parallel file system. Too short loses the work since the last periodic save; too long idles
#   at most 40 min of a 24 h slot. Check max `timing/step` in RUN_DIR/metrics.jsonl and change both
#   together: sbatch --signal=B:USR1@SECONDS, SAVE_GRACE_S=SECONDS.
#   By hand: `scancel --batch --signal=USR1 JOB` saves and requeues now; `--signal=USR2` saves and
#   ends. SIGTERM (scancel, the time limit itself, preemption) reaches every process at once: the
#   trainer saves if Slurm's KillWait/GraceTime allows, this shell keeps waiting for srun (its
#   exit would end the job and kill the step) and requeues nothing (preemption with
#   PreemptMode=REQUEUE requeues the job itself).
#
# Logs: RUN_DIR/logs/JOB_ID/attempt_N/ (N = SLURM_RESTART_COUNT): batch.log (this script's
# decisions), nodeK.log (node K's output, ranks prefixed [defaultL]:), torchrun/nodeK/ (per-rank
# files; ROLLOUT_NODES > 0: rollout_ and train_ before each), progress/ and stacks/ (every process's
# place and, after a stall, its stacks; stacks.txt all of them). Progress: RUN_DIR/metrics.jsonl and
# TensorBoard in RUN_DIR/tensorboard.
set -euo pipefail

# Settings; the environment wins. Relative paths are taken from REPO_DIR.
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}   # sbatch runs a copy of this file: submit from the repo root
MODEL_PATH=${MODEL_PATH:-}                         # required: Qwen2.5-32B base, HF or Megatron (convert_checkpoint.sh) dir
DATA_PATH=${DATA_PATH:-}                           # required: DAPO-Math-17K prompts (parquet or jsonl)
VAL_PATH=${VAL_PATH:-}                             # required: AIME 2024 for avg@32 every 5 steps, or none
RUN_DIR=${RUN_DIR:-runs/dapo_math_qwen2.5_32b}     # checkpoints, metrics, FINISHED
LOG_DIR=${LOG_DIR:-$RUN_DIR/logs}
CONFIG=${CONFIG:-examples/dapo_math_qwen2.5_32b.yaml}
VENV=${VENV:-$REPO_DIR/.venv}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_PORT=${RDZV_PORT:-29500}
SAVE_GRACE_S=${SAVE_GRACE_S:-2400}                 # torchrun's wait for workers after a signal; >= the --signal lead
ROLLOUT_NODES=${ROLLOUT_NODES:-0}                  # asynchronous DAPO: the first R nodes run the engines; 0: colocated
TRANSPORT_PORT=${TRANSPORT_PORT:-29600}            # async: the rollout controller's ports on the first node (this, +1)

# shellcheck source=slurm/lib.sh
source "$REPO_DIR/slurm/lib.sh" 2>/dev/null ||
    { echo "error: REPO_DIR=$REPO_DIR has no slurm/lib.sh: submit from the repository root or set REPO_DIR" >&2 && exit 2; }

dry_run=0
if dry_run_flag "${BASH_SOURCE[0]}" "${1:-}"; then dry_run=1 && shift; fi
for arg in "$@"; do
    [[ $arg == *=* && $arg != -* ]] ||
        die "argument '$arg': expected a dotted config override key=value (e.g. trainer.total_steps=200); --dry-run goes first"
done

require SLURM_JOB_ID "the Slurm job id: submit with sbatch or run inside salloc (any value for --dry-run)"
require SLURM_JOB_NODELIST "the job's node list, e.g. gpu[001-016] (set by Slurm)"
require SLURM_NNODES "the number of nodes in the job (set by Slurm)"
require MODEL_PATH "the Qwen2.5-32B base checkpoint directory: Hugging Face, or Megatron from slurm/convert_checkpoint.sh hf-to-megatron"
require DATA_PATH "the DAPO-Math-17K prompt file (parquet or jsonl)"
require VAL_PATH "the AIME 2024 file evaluated every eval.every steps (parquet or jsonl), or 'none' for no evaluation"
for name in SLURM_NNODES GPUS_PER_NODE RDZV_PORT SAVE_GRACE_S TRANSPORT_PORT; do require_int "$name"; done
if [[ ! $ROLLOUT_NODES =~ ^[0-9]+$ ]] || ((ROLLOUT_NODES >= SLURM_NNODES)); then
    die "ROLLOUT_NODES='$ROLLOUT_NODES': expected 0 (colocated) or the number of nodes that run the engines, fewer" \
        "than the job's $SLURM_NNODES (the rest train)"
fi

[[ -f $REPO_DIR/megatron_dapo/train.py ]] ||
    die "REPO_DIR=$REPO_DIR has no megatron_dapo/train.py: submit from the repository root or set REPO_DIR"
cd "$REPO_DIR"
REPO_DIR=$(pwd -P)
MODEL_PATH=$(realpath -m -- "$MODEL_PATH")
DATA_PATH=$(realpath -m -- "$DATA_PATH")
RUN_DIR=$(realpath -m -- "$RUN_DIR")
LOG_DIR=$(realpath -m -- "$LOG_DIR")
[[ -f $CONFIG ]] || die "CONFIG=$CONFIG: no such file in $REPO_DIR"
[[ -x $VENV/bin/torchrun ]] || die "VENV=$VENV has no bin/torchrun: expected the project's virtualenv (make test creates .venv)"
[[ -f $MODEL_PATH/config.json ]] ||
    die "MODEL_PATH=$MODEL_PATH has no config.json: expected a Hugging Face model or a converted Megatron checkpoint directory"
[[ -f $DATA_PATH ]] || die "DATA_PATH=$DATA_PATH: no such file"
if [[ $VAL_PATH == none ]]; then
    validation=(eval.every=0)
else
    VAL_PATH=$(realpath -m -- "$VAL_PATH")
    [[ -f $VAL_PATH ]] || die "VAL_PATH=$VAL_PATH: no such file (VAL_PATH=none turns evaluation off)"
    validation=("data.val_files=[$VAL_PATH]")
fi

command -v scontrol >/dev/null || die "scontrol not found on PATH: it expands SLURM_JOB_NODELIST"
hostnames=$(scontrol show hostnames "$SLURM_JOB_NODELIST") ||
    die "scontrol show hostnames '$SLURM_JOB_NODELIST' failed: expected a Slurm node list"
mapfile -t hosts <<<"$hostnames"
((${#hosts[@]} == SLURM_NNODES)) ||
    die "SLURM_NNODES=$SLURM_NNODES but SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST holds ${#hosts[@]} hosts"
head_node=${hosts[0]}
node_addr() { # NAME: the address Slurm reaches node NAME at (its NodeAddr; the name where scontrol does not say)
    local addr
    addr=$(scontrol show node "$1" --oneliner 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2) || true
    echo "${addr:-$1}"
}

job_log=$LOG_DIR/$SLURM_JOB_ID/attempt_${SLURM_RESTART_COUNT:-0}
export DAPO_LOG_DIR=$job_log # every process's progress record and stacks (megatron_dapo/launch/watchdog.py)
train=(-m megatron_dapo.train --config "$CONFIG" "trainer.run_dir=$RUN_DIR" "model.hf_path=$MODEL_PATH"
    "data.train_files=[$DATA_PATH]" "${validation[@]}" "$@")
# a requeued attempt continues the run it saved, whatever the config says (examples/tiny_cpu.yaml does not resume)
if ((${SLURM_RESTART_COUNT:-0} > 0)); then train+=(trainer.resume=true); fi
sides=(all)
if ((ROLLOUT_NODES)); then # two srun steps on nodes of their own; they meet at the rollout controller on the first node
    sides=(rollout train)
    train+=(pipeline.mode=async "pipeline.rollout_gpus=$((ROLLOUT_NODES * GPUS_PER_NODE))")
    meet=("DAPO_TRANSPORT=$(node_addr "$head_node"):$TRANSPORT_PORT" "DAPO_TRAIN_PROCS=$(((SLURM_NNODES - ROLLOUT_NODES) * GPUS_PER_NODE))")
fi
# side NAME: one side's srun step in `srun`, its nodes in `step_hosts`, their torchrun_node.sh arguments in
# `node_args`. all: the colocated job's one step on every node; rollout: the first ROLLOUT_NODES nodes, train: the
# rest, each with its role and the meeting point in its environment, a rendezvous and logs of its own.
side() {
    local first=0 count=$SLURM_NNODES port=$RDZV_PORT tag="" rdzv_id=$SLURM_JOB_ID own=()
    case $1 in
        rollout) count=$ROLLOUT_NODES ;;
        train) first=$ROLLOUT_NODES count=$((SLURM_NNODES - ROLLOUT_NODES)) port=$((RDZV_PORT + 1)) ;;
    esac
    step_hosts=("${hosts[@]:first:count}")
    if [[ $1 != all ]]; then
        tag=${1}_ rdzv_id=$SLURM_JOB_ID-$1
        own=(--nodelist="$(IFS=, && echo "${step_hosts[*]}")"
            --export="$(IFS=, && echo "ALL,DAPO_ROLE=$1,${meet[*]}")")
    fi
    node_args=("$job_log/${tag}torchrun" "$VENV/bin/torchrun" --nnodes="$count" --nproc-per-node="$GPUS_PER_NODE"
        --rdzv-backend=c10d --rdzv-endpoint="$(node_addr "${step_hosts[0]}"):$port" --rdzv-id="$rdzv_id" --max-restarts=0
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" --shutdown-timeout="$SAVE_GRACE_S" --tee=3
        "${train[@]}")
    # Since Slurm 22.05 a step does not inherit the job's CPUs per task: give the one task the whole node.
    srun=(srun --nodes="$count" --ntasks="$count" --ntasks-per-node=1 "${own[@]}"
        ${SLURM_CPUS_ON_NODE:+"--cpus-per-task=$SLURM_CPUS_ON_NODE"} --kill-on-bad-exit=1
        --chdir="$REPO_DIR" --output="$job_log/${tag}node%n.log" bash "$REPO_DIR/slurm/torchrun_node.sh"
        "${node_args[@]}")
}

if ((dry_run)); then
    for name in "${sides[@]}"; do
        side "$name"
        what=""
        [[ $name == all ]] || what="$name "
        echo "# srun${what:+ (${what}side)}, run once by the batch script on $head_node:"
        quote "${srun[@]}"
        for i in "${!step_hosts[@]}"; do
            echo "# ${what}node $i of ${#step_hosts[@]}: ${step_hosts[i]}$( ((i > 0)) || echo " (rendezvous host)")"
            SLURM_NODEID=$i bash "$REPO_DIR/slurm/torchrun_node.sh" --print "${node_args[@]}"
        done
    done
    exit 0
fi

mkdir -p "$job_log"
log() {
    echo "[$(date '+%F %T')] $*" | tee -a "$job_log/batch.log"
}
latest() { # the checkpoint that checkpoints/latest names, or nothing
    cat "$RUN_DIR/checkpoints/latest" 2>/dev/null || true
}

# A FINISHED left by an earlier launch (e.g. before trainer.total_steps was raised) must not mark this one done.
rm -f "$RUN_DIR/FINISHED"
latest_before=$(latest)
stop_signal=""
srun_pid=""
# shellcheck disable=SC2317  # called by the traps below
on_signal() { # SIG: remember the first stop signal; pass USR1/USR2 on to the step as SIGUSR1
    [[ -z $stop_signal ]] || return 0
    stop_signal=$1
    log "got SIG$1"
    # SIGTERM is not passed on: Slurm sends it to every process, and a second one cuts torchrun's wait short.
    if [[ $1 != TERM && -n $srun_pid ]]; then kill -USR1 "$srun_pid" 2>/dev/null || true; fi
}
trap 'on_signal USR1' USR1
trap 'on_signal USR2' USR2
trap 'on_signal TERM' TERM

log "job $SLURM_JOB_ID attempt ${SLURM_RESTART_COUNT:-0}: $SLURM_NNODES nodes x $GPUS_PER_NODE GPUs" \
    "($( ((ROLLOUT_NODES)) && echo "async: $ROLLOUT_NODES of them rollout, transport $head_node:$TRANSPORT_PORT" ||
        echo colocated)), rendezvous $head_node:$RDZV_PORT, run dir $RUN_DIR," \
    "latest checkpoint: ${latest_before:-none}, logs: $job_log"
rollout_pid="" rollout_rc=""
if ((ROLLOUT_NODES)); then # the engines first: the train side connects to their controller
    side rollout
    log "$(quote "${srun[@]}")"
    "${srun[@]}" &
    rollout_pid=$!
fi
side "${sides[-1]}" # all, or train: the step whose end and signals decide the job
log "$(quote "${srun[@]}")"
"${srun[@]}" &
srun_pid=$!
# a USR1/USR2 that arrived before srun's pid was known (its trap could not pass it on) is passed on now
if [[ -n $stop_signal && $stop_signal != TERM ]]; then kill -USR1 "$srun_pid" 2>/dev/null || true; fi
# wait returns early when a trapped signal arrives; keep waiting until srun itself has ended. With two steps, look
# at the rollout step every second too: one that fails stops the train step at once (nothing would stop it else).
while :; do
    rc=0
    if [[ -n $rollout_pid && -z $rollout_rc ]]; then
        if ! kill -0 "$rollout_pid" 2>/dev/null; then
            rollout_rc=0
            wait "$rollout_pid" || rollout_rc=$?
            if ((rollout_rc != 0)); then
                log "the rollout step exited with status $rollout_rc: stopping the train step"
                { kill -INT "$srun_pid" && sleep 0.3 && kill -INT "$srun_pid"; } 2>/dev/null || true # twice: srun kills it
            fi
            continue
        fi
        sleep 1 &
        wait $! || true
        kill -0 "$srun_pid" 2>/dev/null && continue
    fi
    wait "$srun_pid" || rc=$?
    kill -0 "$srun_pid" 2>/dev/null || break
done
if [[ -n $rollout_pid && -z $rollout_rc ]]; then # the train side has told the controller to stop, or failed
    for _ in $(seq 600); do
        kill -0 "$rollout_pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$rollout_pid" 2>/dev/null; then
        log "the rollout step is still running 60 s after the train step ended: cancelling it"
        kill -INT "$rollout_pid" 2>/dev/null && sleep 0.3 && kill -INT "$rollout_pid" 2>/dev/null # twice: srun kills it
    fi
    rollout_rc=0
    wait "$rollout_pid" || rollout_rc=$?
    ((rollout_rc == 0)) || log "the rollout step exited with status $rollout_rc"
fi

if [[ -f $RUN_DIR/FINISHED ]]; then
    log "run finished at step $(<"$RUN_DIR/FINISHED")"
    exit 0
fi
latest_now=$(latest)
if [[ -f $job_log/stall.json ]]; then # the run's watchdog ended it: requeue from latest, up to the config's limit
    line=$("$VENV/bin/python" -m megatron_dapo.launch.watchdog --collect "$job_log") || line="see $job_log"
    count_file=$LOG_DIR/$SLURM_JOB_ID/stall_requeues
    stalls=$(cat "$count_file" 2>/dev/null || echo 0)
    limit=$("$VENV/bin/python" -c 'import sys; from megatron_dapo.config import load_config
print(load_config(sys.argv[1], sys.argv[2:]).trainer.stall_requeues)' "$CONFIG" "$@") || limit=0
    if ((stalls < limit)); then
        echo $((stalls + 1)) >"$count_file"
        log "the run stalled ($line): requeue $((stalls + 1)) of trainer.stall_requeues=$limit, from" \
            "${latest_now:-the start}"
        if ! scontrol requeue "$SLURM_JOB_ID"; then
            log "scontrol requeue $SLURM_JOB_ID failed: resubmit by hand, the run resumes from ${latest_now:-the start}"
            exit 75
        fi
        exit 0
    fi
    log "the run stalled ($line); no requeue left (trainer.stall_requeues=$limit): see $job_log/stacks.txt"
    exit 75
fi
case $stop_signal in
    USR1 | USR2)
        if [[ $latest_now == "$latest_before" ]]; then
            log "stopped by SIG$stop_signal but no checkpoint was saved in this job (srun status $rc, latest:" \
                "${latest_now:-none}): not requeued"
            exit 1
        fi
        if [[ $stop_signal == USR2 ]]; then
            log "stopped by SIGUSR2 after saving $latest_now; not requeued"
            exit 0
        fi
        log "saved $latest_now before the time limit: requeueing job $SLURM_JOB_ID, the next attempt resumes from it"
        scontrol requeue "$SLURM_JOB_ID" || {
            log "scontrol requeue $SLURM_JOB_ID failed: resubmit by hand, the run resumes from $latest_now"
            exit 1
        }
        exit 0
        ;;
    TERM)
        log "terminated by SIGTERM (scancel, time limit or preemption), srun status $rc, latest: ${latest_now:-none}; not requeued"
        exit 143
        ;;
    *)
        log "training failed with srun status $rc before trainer.total_steps, without a stop signal: not requeued;" \
            "see $job_log"
        exit $((rc == 0 ? 1 : rc))
        ;;
esac
