#!/usr/bin/env bash
# One machine, all of its GPUs (or NUM_GPUS of them):
#   launchers/single_node.sh configs/cc3m_fastclip_v3.json [--set key=value ...] [--resume latest]
set -euo pipefail
config=${1:?usage: single_node.sh CONFIG.json [eva-fastclip train options]}
shift
gpus=${NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$gpus" -gt 0 ] || gpus=1
exec deepspeed --num_gpus "$gpus" --master_port "${MASTER_PORT:-29500}" \
    --module eva_fastclip train --config "$config" "$@"
