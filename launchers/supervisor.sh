# Sourced by the launchers: the array "supervised" runs deepspeed under the launch supervisor
# (python3 -m eva_fastclip.reliability.supervisor, or $PYTHON -m ...; docs/launching.md): the command
# returns only after every rank has saved and exited, with 75 when the run was preempted and saved, else
# the ranks' own code; a stop signal to it reaches the ranks. MAX_RESTARTS=N > 0 also reruns a failed run
# with --resume latest up to N times, leaving out hosts that no longer answer ssh while MIN_NODES remain
# (docs/reliability.md).
if ! [[ ${MAX_RESTARTS:-0} =~ ^[0-9]+$ && ${MIN_NODES:-1} =~ ^[1-9][0-9]*$ ]]; then
    echo "$(basename "$0"): MAX_RESTARTS=${MAX_RESTARTS:-0} and MIN_NODES=${MIN_NODES:-1} must be whole numbers" \
        "(MIN_NODES at least 1)" >&2
    exit 2
fi
supervised=("${PYTHON:-python3}" -m eva_fastclip.reliability.supervisor --max-restarts "${MAX_RESTARTS:-0}"
            --min-nodes "${MIN_NODES:-1}" --)
