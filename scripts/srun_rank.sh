#!/usr/bin/env bash
# One training rank under `srun` (one task per GPU): torch.distributed's variables from Slurm's, then exec.
# srun delivers Slurm's warning signal (sbatch --signal=USR1@T) to every task, so each rank sees it directly.
set -euo pipefail
export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS
export LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
exec "$@"
