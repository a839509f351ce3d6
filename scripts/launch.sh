#!/usr/bin/env bash
# Launch pretrain_gpt.py on this node or on a Slurm allocation.
#
#   scripts/launch.sh --config 125m                          # this machine, all its GPUs (deepspeed)
#   scripts/launch.sh --config 7b --launcher srun -- --coat-fp8 --data-path /data/web_text_document
#   scripts/launch.sh --dry-run --config 1.3b                # print the commands, run nothing
#
# Inside a Slurm job (SLURM_JOB_NODELIST set) the nodes come from `scontrol show hostnames`, the master
# address is the first of them and the port is derived from the job id. Launchers:
#   deepspeed  a hostfile ("node slots=GPUS"), `deepspeed --hostfile ... --master_addr ...` (pdsh/ssh to nodes)
#   srun       one task per GPU (scripts/srun_rank.sh maps SLURM_PROCID → RANK); Slurm's signals reach every
#              rank, so preemption (SIGUSR1/SIGTERM → save and exit 0) works without a forwarding launcher
#   torchrun   one torchrun per node through srun (c10d rendezvous on the master)
# Checkpoints go to $CKPT_DIR (default checkpoints/<config>) with --save and --load both pointing there, so a
# requeued or resubmitted job resumes from the newest complete checkpoint. Flags after `--` are appended.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY_RUN=${DRY_RUN:-0}
CONFIG=125m
LAUNCHER=${LAUNCHER:-deepspeed}
GPUS=${GPUS_PER_NODE:-}
PYTHON=${PYTHON:-python}

usage() { sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --config) CONFIG=$2; shift 2 ;;
    --launcher) LAUNCHER=$2; shift 2 ;;
    --gpus-per-node) GPUS=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "launch.sh: unknown option $1 (flags for pretrain_gpt.py go after --)" >&2; exit 2 ;;
  esac
done
EXTRA=("$@")

CONFIG_FILE=$ROOT/scripts/configs/$CONFIG.sh
if [[ ! -f $CONFIG_FILE ]]; then
  echo "launch.sh: no config '$CONFIG' (have: $(cd "$ROOT/scripts/configs" && ls *.sh | sed 's/\.sh$//' | tr '\n' ' '))" >&2
  exit 2
fi
# shellcheck source=/dev/null
source "$CONFIG_FILE"

if [[ -z $GPUS ]]; then
  if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then GPUS=$SLURM_GPUS_ON_NODE
  elif command -v nvidia-smi >/dev/null 2>&1; then GPUS=$(nvidia-smi -L | wc -l)
  else GPUS=1
  fi
fi
if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
  mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
else
  HOSTS=("$(hostname)")
fi
NNODES=${#HOSTS[@]}
if [[ $NNODES -eq 0 ]]; then echo "launch.sh: scontrol listed no hosts for '$SLURM_JOB_NODELIST'" >&2; exit 2; fi
MASTER_ADDR=${MASTER_ADDR:-${HOSTS[0]}}
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
CKPT_DIR=${CKPT_DIR:-$ROOT/checkpoints/$CONFIG}
LOG_DIR=${LOG_DIR:-$ROOT/logs/$CONFIG}

ARGS=("${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" --save "$CKPT_DIR" --load "$CKPT_DIR"
      --log-json "$LOG_DIR/train.json" --tensorboard-dir "$LOG_DIR/tensorboard" "${EXTRA[@]}")
PRETRAIN=$ROOT/pretrain_gpt.py

case "$LAUNCHER" in
  deepspeed)
    if [[ $NNODES -gt 1 ]]; then
      HOSTFILE=$LOG_DIR/hostfile.${SLURM_JOB_ID:-local}
      HOSTFILE_TEXT=$(for h in "${HOSTS[@]}"; do echo "$h slots=$GPUS"; done)
      CMD=(deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
           "$PRETRAIN" "${ARGS[@]}")
    else
      CMD=(deepspeed --num_gpus "$GPUS" --master_port "$MASTER_PORT" "$PRETRAIN" "${ARGS[@]}")
    fi ;;
  srun)
    CMD=(srun --nodes "$NNODES" --ntasks-per-node "$GPUS" --kill-on-bad-exit=1
         env MASTER_ADDR="$MASTER_ADDR" MASTER_PORT="$MASTER_PORT" "$ROOT/scripts/srun_rank.sh"
         "$PYTHON" "$PRETRAIN" "${ARGS[@]}") ;;
  torchrun)
    CMD=(srun --nodes "$NNODES" --ntasks-per-node 1 torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS"
         --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${SLURM_JOB_ID:-local}"
         "$PRETRAIN" "${ARGS[@]}") ;;
  *) echo "launch.sh: --launcher must be deepspeed, srun or torchrun, got '$LAUNCHER'" >&2; exit 2 ;;
esac

echo "# $NNODES node(s) x $GPUS GPU(s): ${HOSTS[*]}; master $MASTER_ADDR:$MASTER_PORT; config $CONFIG"
if [[ -n ${HOSTFILE:-} ]]; then
  echo "# hostfile $HOSTFILE:"
  echo "$HOSTFILE_TEXT" | sed 's/^/#   /'
fi
printf '%q ' "${CMD[@]}"; echo
if [[ $DRY_RUN == 1 ]]; then exit 0; fi
mkdir -p "$CKPT_DIR" "$LOG_DIR"
if [[ -n ${HOSTFILE:-} ]]; then echo "$HOSTFILE_TEXT" > "$HOSTFILE"; fi
exec "${CMD[@]}"
