# Sourced by the launchers of one node: MASTER_PORT, the port rank 0 listens on. Unset, a free port of this
# host, so that two runs on one node do not both take DeepSpeed's 29500 (the second died with a raw
# EADDRINUSE trace); set but in use, one line that names it, and exit 2 before anything starts.
# In use means a listener: the bind sets SO_REUSEADDR as rank 0's TCPStore does, so a port that a finished
# run's store left in TIME_WAIT (about a minute) is free to it, as it is to the store.
port_in_use() {
    ! python3 -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("", int(sys.argv[1])))' "$1" 2>/dev/null
}
if [ -z "${MASTER_PORT:-}" ]; then
    MASTER_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
elif port_in_use "$MASTER_PORT"; then
    echo "$(basename "$0"): MASTER_PORT=$MASTER_PORT is in use on this host (another run?): set MASTER_PORT" \
        "to a free port, or unset it to have one picked" >&2
    exit 2
fi
export MASTER_PORT
