# Sourced by the launchers of one node: MASTER_PORT, the port rank 0 listens on. Unset, a free port of this
# host, so that two runs on one node do not both take DeepSpeed's 29500 (the second died with a raw
# EADDRINUSE trace); set, it must be a port rank 0 can listen on, or one line says what is wrong with it and
# the launcher exits 2 before anything starts: not a number, not in 1-65535, below 1024 without root, or in
# use. In use means a listener: the bind sets SO_REUSEADDR as rank 0's TCPStore does, so a port that a
# finished run's store left in TIME_WAIT (about a minute) is free to it, as it is to the store.
port_problem() {  # prints what is wrong with MASTER_PORT=$1, nothing when rank 0 can listen on it
    python3 - "$1" <<'PY'
import errno, socket, sys
value = sys.argv[1]
fix = "set MASTER_PORT to a free port, or unset it to have one picked"
if not value.isdigit():
    sys.exit(print(f"MASTER_PORT={value} is not a port number: {fix}"))
port = int(value)
if not 1 <= port <= 65535:
    sys.exit(print(f"MASTER_PORT={value} is not a port (1-65535): {fix}"))
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("", port))
except OSError as err:
    if err.errno == errno.EADDRINUSE:
        print(f"MASTER_PORT={port} is in use on this host (another run?): {fix}")
    elif err.errno == errno.EACCES:
        print(f"MASTER_PORT={port} is below 1024, which only root may listen on: {fix}")
    else:
        print(f"MASTER_PORT={port} cannot be listened on here ({err.strerror}): {fix}")
PY
}
if [ -z "${MASTER_PORT:-}" ]; then
    MASTER_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
else
    problem=$(port_problem "$MASTER_PORT")
    if [ -n "$problem" ]; then
        echo "$(basename "$0"): $problem" >&2
        exit 2
    fi
fi
export MASTER_PORT
