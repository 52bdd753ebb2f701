"""The rank's process: joining the process group, its generators, its host memory.

Set up once per process, before the Trainer builds anything (engine/trainer.py's set-up order): the
process group (DeepSpeed's, on a free local port when run without a launcher; a port in use is one line
naming it), threads and host memory on CPU ranks, and the random generators a run saves and restores.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from eva_fastclip.config import ConfigError


def local_world_size() -> int:
    """Ranks on this machine: torchrun's LOCAL_WORLD_SIZE, DeepSpeed's launch.py's LOCAL_SIZE (it sets no
    LOCAL_WORLD_SIZE), else every rank of the run (one machine)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        if os.environ.get(key):
            return int(os.environ[key])
    return 1


def share_cores_among_ranks() -> None:
    """CPU ranks on one machine share its cores: without this each rank starts one thread per core, and
    their threads spin waiting for cores the other ranks hold (several times the CPU time for the same
    work). A rank alone keeps its process's choice: torch's own (its physical cores) or one made before."""
    ranks = local_world_size()
    if ranks > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's random generators: Python's, NumPy's, torch's (CPU; CUDA where there is one)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` run by rank 0 of the process group (by the only process without one), and its result, or
    its exception, on every rank: a rank that failed alone would leave the others waiting in the broadcast."""
    group = dist.is_initialized() and dist.get_world_size() > 1
    box: list[Any] = [None]
    if not group or dist.get_rank() == 0:
        try:
            box = [(True, fn())]
        except Exception as err:  # every rank must hear of it, or they wait forever
            box = [(False, err)]
    if group:
        dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


@dataclass(frozen=True, slots=True)
class Rank:
    """This process's place in the run."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def join_process_group(watchdog=None) -> Rank:
    """Join the run's process group (reliability/process.py's set-up of the process first); the hang
    watchdog's heartbeats and guardian start once the group's store is up (reliability/watchdog.py). On
    CUDA, PyTorch's Flight Recorder is switched on for NCCL before the group starts (a user's settings
    win)."""
    if watchdog is not None and torch.cuda.is_available():
        for key, value in watchdog.flight_recorder_env().items():
            os.environ.setdefault(key, value)
    rank, world_size, device = init_process_group()
    if watchdog is not None:
        watchdog.connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return Rank(rank, world_size, device)


def init_process_group() -> tuple[int, int, torch.device]:
    """Start (or join) DeepSpeed's process group; returns (rank, world size, this rank's device)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        share_cores_among_ranks()
        keep_freed_host_memory()
    _default_rendezvous_env()
    try:
        deepspeed.init_distributed()
    except dist.DistNetworkError as err:
        if "EADDRINUSE" not in str(err):
            raise
        port = os.environ.get("MASTER_PORT")
        raise ConfigError(
            f"MASTER_PORT={port} is in use on {socket.gethostname()} (another run?): launch with another "
            "port (deepspeed --master_port N, or MASTER_PORT for launchers/single_node.sh, which picks a "
            "free one when it is unset)"
        ) from None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    device = torch.device(
        accelerator.device_name(local_rank) if accelerator.device_name() != "cpu" else "cpu"
    )
    if accelerator.device_name() == "cpu":
        unlink_shm_allreduce_buffer()
    return dist.get_rank(), dist.get_world_size(), device


def unlink_shm_allreduce_buffer() -> bool:
    """Remove this rank's name of DeepSpeed's CPU all-reduce buffer from /dev/shm; returns whether it did.

    DeepSpeed's shm comm op (CPU accelerator, all ranks on one host) creates a 67 MB
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` per rank and never removes it: every
    launch leaked them until /dev/shm filled up. Once every rank has mapped every buffer (the barrier),
    the names can go: the mappings stay valid until the processes exit, and then the memory is freed,
    however a process ends."""
    name = (
        f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
        f"{os.environ.get('MASTER_PORT')}_{dist.get_rank()}"
    )
    dist.barrier()  # every rank opens every other rank's buffer by name during initialisation
    try:
        os.unlink(name)
    except FileNotFoundError:  # ranks on several hosts: DeepSpeed uses no shared buffer
        return False
    return True


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the OS.

    A training step on CPU allocates the same large buffers every time (gradients, optimizer temporaries,
    DeepSpeed's copies). By default glibc returns them to the OS when freed, and the next step pays a page
    fault for every 4 KiB it touches again. Blocks over 32 MiB (the most glibc's mmap threshold accepts) are
    always fresh mappings unless mmap is switched off: for ViT-B-16 at batch 8 that is DeepSpeed's 300 MB
    gradient partition, rebuilt every step, and the token embedding's gradient, about 75,000 faults and
    0.5 s a step on 2 cores. Returns False where there is no glibc (nothing changes then).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4
    return all(
        (
            mallopt(m_trim_threshold, 2**31 - 1),  # never trim the heap's free top
            mallopt(m_top_pad, 2**30),  # grow the heap in 1 GiB steps
            mallopt(m_mmap_max, 0),  # every block from the heap, none from a fresh mmap (freed at once)
        )
    )


def _default_rendezvous_env() -> None:
    """Let ``eva-fastclip train`` run as one process without the launcher (on a free local port)."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)


def memory_in_use_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30
