#!/bin/bash
# Multi-node distillation under SLURM: one `accelerate launch` per node, which starts one process per GPU.
# A template: adapt the #SBATCH lines, CONFIG/TRAINER and the environment setup to your cluster.
#   sbatch scripts/slurm_distill.sh +experiment=distill_med [more Hydra overrides]
#SBATCH --job-name=specdraft-distill
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one launcher per node; accelerate starts the per-GPU processes
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=12:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

CONFIG=${CONFIG:-conf/accelerate/deepspeed_zero2.yaml}   # ddp.yaml | deepspeed_zero2.yaml | deepspeed_zero3.yaml
TRAINER=${TRAINER:-deepspeed_zero2}                      # the trainer= config of the same name
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"             # the repository root (accelerate configs use relative paths)

# What accelerate needs on every node: the rendezvous address and port (the first node), the node count, this
# node's rank and the total process count.
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-29500}
export NUM_MACHINES=$SLURM_NNODES
export NUM_PROCESSES=$((SLURM_NNODES * GPUS_PER_NODE))
# Every node writes into the same run directory on the shared filesystem (Hydra's default name has a clock).
RUN_DIR=${RUN_DIR:-outputs/slurm/${SLURM_JOB_ID}}

# srun runs this once per node; SLURM_NODEID is evaluated on each node (hence the single quotes).
srun --kill-on-bad-exit=1 bash -c 'accelerate launch \
  --config_file "'"$CONFIG"'" \
  --num_machines "$NUM_MACHINES" \
  --num_processes "$NUM_PROCESSES" \
  --machine_rank "$SLURM_NODEID" \
  --main_process_ip "$MASTER_ADDR" \
  --main_process_port "$MASTER_PORT" \
  --rdzv_backend static \
  -m train trainer='"$TRAINER"' hydra.run.dir='"$RUN_DIR"' "$@"' _ "$@"
