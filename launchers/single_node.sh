#!/usr/bin/env bash
# One machine: the GPUs CUDA_VISIBLE_DEVICES names (the first NUM_GPUS of them), else all of its GPUs (or
# NUM_GPUS of them):
#   launchers/single_node.sh configs/cc3m_rn50_fastclip_v3.json [--set key=value ...] [--resume latest]
#   CUDA_VISIBLE_DEVICES=4,5,6,7 launchers/single_node.sh CONFIG.json     # a shared node: GPUs 4-7 only
#   MAX_RESTARTS=3 launchers/single_node.sh CONFIG.json     # a failed run goes on from its last checkpoint
# This is the command to give a scheduler (PID 1 of a container, a job script's main process): a stop signal
# to it reaches the ranks, and it returns once they have saved and exited: 75 for a preempted, saved run.
set -euo pipefail
config=${1:?usage: single_node.sh CONFIG.json [eva-fastclip train options]}
shift
# MASTER_PORT: a free port unless set (a port in use stops here, naming it)
source "$(dirname "$0")/master_port.sh"
# deepspeed runs under the launch supervisor: this command returns after the ranks' save (supervisor.sh)
source "$(dirname "$0")/supervisor.sh"

if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    # DeepSpeed's launcher drops CUDA_VISIBLE_DEVICES as soon as --num_gpus is given and then uses GPUs
    # 0..N-1, another job's GPUs on a shared node: name the visible ones with --include instead.
    IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
    for device in "${visible[@]}"; do
        if ! [[ $device =~ ^[0-9]+$ ]]; then
            echo "single_node.sh: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES: DeepSpeed's --include takes GPU" \
                "indices, not '$device'; give indices (nvidia-smi -L lists them)" >&2
            exit 2
        fi
    done
    gpus=${NUM_GPUS:-${#visible[@]}}
    if ! [[ $gpus =~ ^[0-9]+$ ]] || [ "$gpus" -lt 1 ] || [ "$gpus" -gt "${#visible[@]}" ]; then
        echo "single_node.sh: NUM_GPUS=$gpus, but CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES names" \
            "${#visible[@]} GPU(s): set NUM_GPUS between 1 and ${#visible[@]}, or unset it" >&2
        exit 2
    fi
    chosen=$(IFS=,; echo "${visible[*]:0:$gpus}")
    # unset, so that the launcher sees every GPU and --include picks these; it sets it again for each rank
    exec env -u CUDA_VISIBLE_DEVICES "${supervised[@]}" deepspeed --include "localhost:$chosen" \
        --master_port "$MASTER_PORT" --module eva_fastclip train --config "$config" "$@"
fi

gpus=${NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$gpus" -gt 0 ] || gpus=1
exec "${supervised[@]}" deepspeed --num_gpus "$gpus" --master_port "$MASTER_PORT" \
    --module eva_fastclip train --config "$config" "$@"
