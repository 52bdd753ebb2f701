"""Loader worker processes: started from a fork server, and working on through a request to stop.

A worker forked straight from a rank can hang for good in CPython 3.11's after-fork cleanup when a helper
thread of the rank (a previous loader's pin-memory or feeder thread, an evaluation loader's) is exiting
at that moment (seen: rank 1's evaluation worker waiting in _PyThreadState_DeleteExcept, the other rank
waiting for it). Both loaders start their workers from a fork server instead: one single-threaded
process, started once per rank, that forks each worker.

DeepSpeed's launch.py sends SIGTERM (after SIGINT) to every process of a rank's tree, and a scheduler's
signal may reach them all: a worker killed by it would end the step in flight with a broken loader,
while the rank itself finishes that step and saves a checkpoint (reliability/preemption.py). So workers ignore
the signals that ask a run to stop, and go when their rank does (PyTorch's workers watch their parent).
Ignoring SIGTERM also defeats the ``terminate()`` that multiprocessing sends its daemonic children when the
rank's interpreter exits, and then joins them: a rank leaving with a loader iterator alive (an exception
out of the loop) would wait for its worker forever. So the rank kills its workers at exit first.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import multiprocessing
import os
import signal
import socket
import sys
import threading

#: what the fork server imports before it forks a worker
FORK_SERVER_PRELOAD = (
    "eva_fastclip.data.fork_server",  # first: the server dies with its rank
    "torch",
    "PIL.Image",
    "open_clip",
    "eva_fastclip.data.train_loader",
    "eva_fastclip.evaluation.samples",
)


def worker_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context of every loader's workers: a fork server, shared by the rank's loaders.
    It imports what the workers need once (open_clip: its tokenizers travel to each worker), so a
    worker starts in a fraction of a second rather than after seconds of imports."""
    _kill_workers_at_exit()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(FORK_SERVER_PRELOAD))
    return context


def worker_init() -> functools.partial:
    """A DataLoader ``worker_init_fn``: each worker takes the rank's environment as it is now (a fork
    server's child has the one the server started with: credentials or an object store's endpoint set
    since would be missing), then ignores the stop signals (reliability/signals.py)."""
    return functools.partial(_start_worker, dict(os.environ))


def _start_worker(environment: dict[str, str], worker_id: int) -> None:
    from eva_fastclip.reliability.signals import ignore_stop_signals

    os.environ.update(environment)
    ignore_stop_signals(worker_id)


def start_worker_server() -> None:
    """Start the fork server now, as a new interpreter that imports the preload: its start-up then overlaps
    the rank's own (model, engine) instead of delaying the first batch. Call it from the rank's main
    thread: the server dies when the thread that started it ends (PR_SET_PDEATHSIG follows the thread,
    not the process)."""
    from multiprocessing import forkserver

    worker_context()
    forkserver.ensure_running()


def fork_worker_server() -> None:
    """At a rank's start, while it runs one thread (before its watchdog and process group) and has not
    touched CUDA: the fork server forked from the rank, as ``ForkServer.ensure_running`` would have
    started a new one. It then has the rank's imports and pays none of its own (~10 s a rank here: torch,
    open_clip), and the first batch does not wait for them. Where that is not safe, or CPython's fork
    server differs (3.13 adds a key to its protocol), :func:`start_worker_server`."""
    from multiprocessing import forkserver

    import torch

    worker_context()
    server = forkserver._forkserver
    attributes = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    if (
        sys.version_info[:2] > (3, 12)
        or not sys.platform.startswith("linux")
        or other_python_threads()  # one could hold a lock the forked server needs
        or torch.cuda.is_initialized()
        or not all(hasattr(server, name) for name in attributes)
        or server._forkserver_pid is not None
    ):
        start_worker_server()
        return
    for module in FORK_SERVER_PRELOAD[1:]:  # the rank's own imports: in the server before the fork
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX)
    address = forkserver.connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # every client holds the write end; the server ends once all have gone
    pid = os.fork()
    if pid == 0:
        keep = sorted({0, 1, 2, listener.fileno(), alive_r})  # clients send the resource tracker's fd
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        try:  # the preload's first module makes it ignore stop signals and die with this process
            forkserver.main(listener.fileno(), alive_r, list(FORK_SERVER_PRELOAD))
        finally:
            os._exit(0)
    listener.close()
    os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def other_python_threads() -> list[str]:
    """The names of this process's other threads that run Python: those of ``threading`` and those started
    with ``_thread`` (execnet's, under pytest-xdist), which ``threading.active_count()`` does not count.
    (Native threads, such as the one importing torch starts, hold no Python lock.)"""
    here = threading.get_ident()
    named = {thread.ident: thread.name for thread in threading.enumerate()}
    return [named.get(ident, f"thread {ident}") for ident in sys._current_frames() if ident != here]


@functools.cache
def _kill_workers_at_exit() -> None:
    # registered after multiprocessing's own exit function, so it runs first (atexit is last in, first out)
    atexit.register(_kill_daemonic_children)


def _kill_daemonic_children() -> None:
    """SIGKILL the loader workers still alive at exit (daemonic children: multiprocessing would only
    terminate() them, which they ignore, and then wait for them)."""
    workers = [child for child in multiprocessing.active_children() if child.daemon]
    if workers:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # PyTorch's handler would report them as failures
    for worker in workers:
        worker.kill()
        worker.join()
