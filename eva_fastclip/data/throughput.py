"""A loader's throughput, as ``eva-fastclip loader-speed`` and ``benchmarks/data_loader.py`` measure it.

:func:`measure` reads ``warmup`` batches untimed (worker start, the shuffle buffer filling), then times
``timed`` more: samples per second of wall time, and samples per CPU-second of the whole loader, the CPU
time (utime + stime from ``/proc/<pid>/stat``) of this process and of every DataLoader worker, read at
both ends of the window while the workers are alive (``getrusage(RUSAGE_CHILDREN)`` would count them only
after they exit, and not the window alone). A thread samples the workers' memory: peak RSS (the kernel's
``VmHWM``) and peak private memory (``Private_Clean + Private_Dirty`` of ``smaps_rollup``: what a worker
adds to the machine). Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

_TICKS = os.sysconf("SC_CLK_TCK")


def descendants() -> list[int]:
    """This process's descendants: the DataLoader workers are its children (fork) or its fork server's
    (ours, data/workers.py; the server, started with the loader, is among the processes left out)."""
    pids: list[int] = []
    parents = ["self"]
    while parents:
        parent = parents.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with contextlib.suppress(OSError):
                    found = [int(p) for p in Path(f"/proc/{parent}/task/{task}/children").read_text().split()]
                    pids += found
                    parents += found
    return pids


def cpu_seconds(pid: int | str, children: bool = False) -> float:
    """utime + stime of a process (all its threads), in seconds, with ``children`` those of its children
    it has waited for (a ``pipe:`` shard's command); 0 for one that has exited."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    own = int(fields[11]) + int(fields[12])
    return (own + (int(fields[13]) + int(fields[14]) if children else 0)) / _TICKS


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def loader_workers(others: set[int]) -> list[int]:
    """This process's descendants but ``others`` whose parent is not one of them: a loader's workers, not
    the commands they run (a ``pipe:`` shard's shell and curl)."""
    new = set(descendants()) - others
    return sorted(pid for pid in new if _parent(pid) not in new)


def memory_mib(pid: int) -> tuple[float, float]:
    """(peak RSS, current private memory) of a process, MiB; zeros for one that has exited."""
    peak = private = 0.0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                private += int(line.split()[1]) / 1024
    return peak, private


class MemorySampler:
    """Samples the worker processes' memory every ``interval`` seconds on a thread of its own."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.others = set(descendants())  # processes started before: not the loader's
        self.peak_rss: dict[int, float] = {}
        self.peak_private: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        for pid in set(descendants()) - self.others:
            rss, private = memory_mib(pid)
            self.peak_rss[pid] = max(self.peak_rss.get(pid, 0.0), rss)
            self.peak_private[pid] = max(self.peak_private.get(pid, 0.0), private)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


def wait_for_workers_to_exit(others: Iterable[int] = frozenset(), timeout: float = 30.0) -> None:
    """Wait until this process has no descendants but ``others`` (started before the loader's workers)."""
    gc.collect()  # a persistent loader's workers stop when its iterator is collected
    deadline = time.monotonic() + timeout
    while set(descendants()) - set(others) and time.monotonic() < deadline:
        time.sleep(0.05)


def measure(
    batches: Iterable, warmup: int, timed: int, workers: int, progress: str | None = None
) -> dict[str, Any]:
    """Read ``warmup + timed`` batches and measure the last ``timed``: wall time, the CPU time of this
    process and its workers, the workers' peak memory, and what a batch is. ``progress``: the label of a
    progress bar (none without). The caller stops the workers (drops the loader) and waits for them to
    exit (:func:`wait_for_workers_to_exit`)."""
    from tqdm import tqdm

    if warmup < 1 or timed < 1:
        raise ValueError(f"warm-up batches ({warmup}) and timed batches ({timed}) must be at least 1")
    others = set(descendants())  # processes this one had started before: not the loader's
    iterator = iter(batches)
    samples = 0
    with MemorySampler() as sampler:
        for i in tqdm(range(warmup + timed), desc=progress, unit="batch", disable=progress is None):
            batch = next(iterator, None)
            if batch is None:
                raise ValueError(f"the loader ended after {i} batches; {warmup + timed} were asked for")
            if i == 0:
                images, tokens = batch[0], batch[1]
            if i == warmup - 1:  # the window starts once the warm-up batches are in
                pids = loader_workers(others)
                cpu0 = time.process_time() + sum(cpu_seconds(pid, children=True) for pid in pids)
                wall0 = time.perf_counter()
            elif i >= warmup:
                samples += len(batch[0])
        wall = time.perf_counter() - wall0
        # this process's own clock is exact; the workers' come in clock ticks (10 ms), so a short window
        # can read 0 for them (it read 0 in all, with /proc's ticks for this process too)
        cpu = time.process_time() + sum(cpu_seconds(pid, children=True) for pid in pids) - cpu0
        sampler.sample()  # the workers are alive until the iterator is dropped
        at_end = loader_workers(others)
        if len(pids) != workers or at_end != pids:
            raise RuntimeError(
                f"expected the loader's {workers} worker processes throughout the timed batches, found "
                f"{pids} at its start and {at_end} at its end (read from /proc/self/task/*/children)"
            )
    with contextlib.suppress(AttributeError):
        iterator.close()  # a generator (ours): ends its DataLoader iterator, which stops the workers
    return {
        "samples": samples,
        "wall_s": wall,
        "cpu_s": cpu,
        "samples_per_s": samples / wall,
        "samples_per_cpu_s": samples / max(cpu, 1e-9),
        "workers": len(pids),
        "worker_peak_rss_mib": max(sampler.peak_rss.values(), default=0.0),
        "worker_peak_private_mib": max(sampler.peak_private.values(), default=0.0),
        **_describe_images(images),
        "token_shape": list(tokens.shape),
        "batch_bytes": _image_bytes(images) + tokens.element_size() * tokens.numel(),
    }


def on_device(loader, device: torch.device) -> Iterator[tuple]:
    """``loader``'s batches, each also made into the model's float32 input on ``device`` as the trainer
    makes it (ours: ``TrainLoader.to_device``, normalised or decoded there; another loader's: a copy), and
    waited for; the host batch is yielded, so that the report says what crossed shared memory."""
    for batch in loader:
        images, tokens = batch[0], batch[1]
        if hasattr(loader, "to_device"):
            loader.to_device(images, device, torch.float32)
        else:
            images.to(device, dtype=torch.float32, non_blocking=True)
        tokens.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        yield batch


def _describe_images(images) -> dict[str, Any]:
    """A batch's images as the report names them: a tensor, or (``data.image_decode=gpu``) a list of
    encoded JPEGs and finished uint8 images."""
    if isinstance(images, torch.Tensor):
        return {"image_dtype": str(images.dtype).removeprefix("torch."), "image_shape": list(images.shape)}
    return {"image_dtype": "JPEG bytes", "image_shape": [len(images)]}


def _image_bytes(images) -> int:
    if isinstance(images, torch.Tensor):
        return images.element_size() * images.numel()
    return sum(_image_bytes(getattr(item, "data", item)) for item in images)
