"""The process group's store as the fault layer uses it: the watchdog's heartbeats and abort mark, which
the guardians read (reliability/watchdog.py, reliability/guardian.py)."""

from __future__ import annotations

import datetime

#: where a rank's watchdog writes what it saw when it ends a hang; every guardian polls it
ABORT_KEY = "eva_fastclip/abort"
#: how often a guardian asks the store
POLL_S = 1.0


def store_client(host: str, port: int):
    """A connection of its own to the process group's store (served by rank 0), which gives up on a request
    after 5 s: a store that does not answer is itself news (rank 0 stopped or gone)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=5)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
