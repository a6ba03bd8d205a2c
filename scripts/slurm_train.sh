#!/usr/bin/env bash
# Multi-node training with SLURM: one torchrun agent per node, c10d rendezvous on the first node.
#
#   sbatch --nodes=4 scripts/slurm_train.sh configs/deit300_dcvit_small.yaml \
#       data.train=/data/imagenet-wds data.val=/data/imagenet-wds output_dir=runs/deit300_dcvit_small
#
# (a directory of shards from scripts/make_wds_shards.py: its train-*.tar and val-*.tar are used;
# a brace pattern works too if quoted: data.train='/data/imagenet-wds/train-{000000..001281}.tar')
#
# Restarts are job-level: torchrun does not restart workers in place (--max-restarts=0; its
# in-place restarts do not meet again across nodes). When the run stops, this script requeues
# the job (scontrol requeue) and the new start continues from the newest valid checkpoint
# (resume=auto):
#   - 180 s before the time limit SLURM sends USR1 to this script (--signal=B:USR1@180); it
#     passes USR1 to the job step, torchrun (--signals-to-handle) passes it to every rank, the
#     ranks finish the update in progress, rank 0 saves, and they exit 75. A scancel, or a
#     preemption, sends TERM, handled the same way. The job is requeued.
#   - a failed run (a lost node or rank: exit 4 with one line naming it) is requeued, at most
#     DCVIT_MAX_REQUEUES times (default 3) in a row of failures. Rank 0 writes its exit code to
#     $DCVIT_EXIT_FILE: a user error (exit 2), a non-finite loss (exit 3) or a Ctrl-C to an
#     interactive srun (exit 130, saved like a stop) is never requeued.
# batch_size is per process: with 4 nodes x 8 GPUs and batch_size=128 the global batch is 4096
# and the lr scales with it (optim.lr is given at optim.lr_batch_size); pass batch_size=32 to
# keep the recipe's 1024.
#SBATCH --job-name=dcvit
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@180
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
config=${1:?usage: sbatch scripts/slurm_train.sh CONFIG.yaml [key=value ...]}
shift
gpus_per_node=${GPUS_PER_NODE:-8}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${MASTER_PORT:-29500}
max_requeues=${DCVIT_MAX_REQUEUES:-3}
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
source scripts/env.sh   # the project's virtual environment

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export NCCL_ASYNC_ERROR_HANDLING=1
export DCVIT_EXIT_FILE=${DCVIT_EXIT_FILE:-$PWD/.dcvit-exit-$SLURM_JOB_ID}
failures_file=$PWD/.dcvit-failures-$SLURM_JOB_ID   # failed starts in a row of this job
rm -f "$DCVIT_EXIT_FILE"

stopped=""
stop() {   # USR1 (the time limit is near) or TERM (scancel, preemption): checkpoint and requeue
    stopped=$1
    scancel --signal=USR1 "$SLURM_JOB_ID.0" 2>/dev/null || true
}
trap 'stop USR1' USR1
trap 'stop TERM' TERM

srun --kill-on-bad-exit=1 torchrun \
    --nnodes="$SLURM_NNODES" --nproc_per_node="$gpus_per_node" \
    --rdzv-backend=c10d --rdzv-endpoint="$head_node:$port" --rdzv-id="$SLURM_JOB_ID" \
    --max-restarts=0 --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    --shutdown-timeout=170 \
    -m train_imagenet --config "$config" resume=auto "$@" &
step=$!
code=0
while true; do   # `wait` returns early when a trapped signal arrives: wait again for the step
    wait "$step" && code=0 || code=$?
    kill -0 "$step" 2>/dev/null || break
done
rank0=$(cat "$DCVIT_EXIT_FILE" 2>/dev/null || echo "none")   # none: rank 0's node was lost
failures=$(cat "$failures_file" 2>/dev/null || echo 0)
if [[ -n $stopped || $rank0 == 75 ]]; then
    rm -f "$failures_file"
    echo "[slurm_train] stopped by ${stopped:-a signal to the ranks} (rank 0 exit $rank0):" \
         "requeueing job $SLURM_JOB_ID; it resumes from its checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
elif (( code == 0 )); then
    rm -f "$failures_file"
elif [[ $rank0 != 2 && $rank0 != 3 && $rank0 != 130 ]] && (( failures < max_requeues )); then
    echo $((failures + 1)) > "$failures_file"
    echo "[slurm_train] the run failed (srun exit $code, rank 0 exit $rank0): requeueing job" \
         "$SLURM_JOB_ID (restart $((failures + 1)) of $max_requeues); it resumes from its checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$code"
