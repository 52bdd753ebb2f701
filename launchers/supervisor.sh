# Sourced by the launchers: with MAX_RESTARTS > 0, the array "restarts" runs deepspeed under the restart
# supervisor (eva_fastclip/reliability/restarts.py: a failed run goes on with --resume latest, up to MAX_RESTARTS
# times; lost hosts left out while MIN_NODES remain); otherwise it is empty and deepspeed runs as it is
# (expanded as ${restarts[@]+"${restarts[@]}"}: an empty array is "unbound" under set -u before bash 4.4).
restarts=()
if [ "${MAX_RESTARTS:-0}" != 0 ]; then
    if ! [[ ${MAX_RESTARTS} =~ ^[0-9]+$ && ${MIN_NODES:-1} =~ ^[1-9][0-9]*$ ]]; then
        echo "$(basename "$0"): MAX_RESTARTS=$MAX_RESTARTS and MIN_NODES=${MIN_NODES:-1} must be whole numbers" \
            "(MIN_NODES at least 1)" >&2
        exit 2
    fi
    restarts=(python -m eva_fastclip.reliability.restarts --max-restarts "$MAX_RESTARTS" --min-nodes "${MIN_NODES:-1}" --)
fi
