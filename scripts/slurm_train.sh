#!/usr/bin/env bash
# Multi-node training with SLURM: one torchrun agent per node, c10d rendezvous on the first node.
#
#   sbatch --nodes=4 scripts/slurm_train.sh configs/deit300_dcvit_small.yaml \
#       data.train=/data/imagenet-wds data.val=/data/imagenet-wds output_dir=runs/deit300_dcvit_small
#
# (a directory of shards from scripts/make_wds_shards.py: its train-*.tar and val-*.tar are used;
# a brace pattern works too if quoted: data.train='/data/imagenet-wds/train-{000000..001281}.tar')
#
# Re-submitting the same command continues the run (resume=auto picks the newest valid checkpoint);
# --max-restarts lets torchrun restart failed workers in place. batch_size is per process: with
# 4 nodes x 8 GPUs and batch_size=128 the global batch is 4096 and the lr scales with it
# (optim.lr is given at optim.lr_batch_size); pass batch_size=32 to keep the recipe's 1024.
#SBATCH --job-name=dcvit
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --time=48:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
config=${1:?usage: sbatch scripts/slurm_train.sh CONFIG.yaml [key=value ...]}
shift
gpus_per_node=${GPUS_PER_NODE:-8}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${MASTER_PORT:-29500}
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
source scripts/env.sh   # the project's virtual environment

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export NCCL_ASYNC_ERROR_HANDLING=1
srun --kill-on-bad-exit=1 torchrun \
    --nnodes="$SLURM_NNODES" --nproc_per_node="$gpus_per_node" \
    --rdzv-backend=c10d --rdzv-endpoint="$head_node:$port" --rdzv-id="$SLURM_JOB_ID" \
    --max-restarts=3 \
    -m train_imagenet --config "$config" resume=auto "$@"
