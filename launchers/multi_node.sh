#!/usr/bin/env bash
# Several machines listed in a hostfile (see hostfile.example and launchers/README.md), started from one of
# them, which DeepSpeed reaches the others from over passwordless ssh (pdsh by default):
#   HOSTFILE=launchers/hostfile MASTER_ADDR=10.0.0.1 launchers/multi_node.sh CONFIG.json [options]
# MASTER_PORT (default 29500) is the port rank 0 listens on. Options after the config go to
# `eva-fastclip train` (--set key=value, --resume latest). Each passes through a shell on every host once
# more: a --set whose value holds quotes (a JSON list of paths) belongs in the config file instead.
# MAX_RESTARTS=N reruns a failed run with --resume latest up to N times, leaving out hosts that no longer
# answer ssh while at least MIN_NODES (default 1) remain (docs/reliability.md).
# tests/launched/test_multi_node.py runs this script across two loopback "hosts" (docs/launching.md).
set -euo pipefail
config=${1:?usage: multi_node.sh CONFIG.json [eva-fastclip train options]}
shift
: "${HOSTFILE:?set HOSTFILE to a DeepSpeed hostfile}"
: "${MASTER_ADDR:?set MASTER_ADDR to an address of the first host that every host can reach}"
# PATH is not forwarded to the other nodes (only PYTHON*, NCCL*, ... and what .deepspeed_env lists):
# record it so the remote ranks find the same python, deepspeed and ninja. DeepSpeed reads the file line
# by line as NAME=value, so end an unfinished last line first.
if ! grep -q '^PATH=' .deepspeed_env 2>/dev/null; then
    [ ! -s .deepspeed_env ] || [ -z "$(tail -c 1 .deepspeed_env)" ] || echo >> .deepspeed_env
    echo "PATH=$PATH" >> .deepspeed_env
fi
# under the launch supervisor: returns after every node's save, 75 when preempted (supervisor.sh)
source "$(dirname "$0")/supervisor.sh"
exec "${supervised[@]}" deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
    --module eva_fastclip train --config "$config" "$@"
