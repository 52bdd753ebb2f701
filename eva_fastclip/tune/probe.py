"""Probes: a layout trained for a few optimizer steps on the real engine, loss and model, in this process.

Each probe builds a :class:`~eva_fastclip.engine.trainer.Trainer` (engine/build.py) of the layout, runs ``1 +
steps`` optimizer steps (the first one untimed: the optimizer's state appears there, and later steps show the
allocator's fragmentation), and records the rank's peak tensor memory from the start of the Trainer's
construction (``torch.cuda.max_memory_allocated`` on a GPU; on a CPU the exact count of
``tensor_memory.StorageTracker``) and the optimizer step's time. Model speed is probed on synthetic batches
(:class:`SyntheticBatches`: the loader's uint8 images, so a cached step holds what it would); the data rate on
the real loader (:func:`data_probe`).

Out of memory is agreed: a rank that runs out marks the probe failed, every rank learns it through one
all-reduce after the probe (Composer's all-reduced flag), and each frees what the probe held (the engine's
gradient hooks keep it alive until ``destroy``) before the next. On a CPU, ``--memory-limit-gib`` makes the
tracker raise ``torch.OutOfMemoryError`` where a device of that size would. A probe that leaves a GPU
unusable (an error other than out-of-memory afterwards) stops the search (:class:`DeviceUnusable`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from eva_fastclip.config import ExperimentConfig
from eva_fastclip.plan.precision import at_stage
from eva_fastclip.tensor_memory import StorageTracker
from eva_fastclip.tune.layouts import Candidate

log = logging.getLogger(__name__)

#: optimizer steps a probe times, after its untimed first
PROBE_STEPS = 3


class DeviceUnusable(RuntimeError):
    """A probe's failure left the GPU unusable for the next one."""


@dataclasses.dataclass
class ProbeResult:
    peak: int | None  # bytes, the largest over the ranks; None after an out-of-memory
    step_s: float | None  # the median optimizer step, the slowest rank's
    oom: bool
    detail: str = ""


class SyntheticBatches:
    """The same micro-batch of random pairs again and again, as TrainLoader hands them (uint8 images,
    normalised at the model's input), with distinct dataset indices per rank and the run's own number of
    per-sample table rows (``table_rows``), so the loss holds the table the run would."""

    def __init__(
        self,
        micro_batch: int,
        image_shape,
        context_length: int,
        rank: int,
        table_rows: int = 0,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed + rank)
        self.images = torch.randint(0, 256, (micro_batch, *image_shape), generator=gen, dtype=torch.uint8)
        self.tokens = torch.randint(1, 1000, (micro_batch, context_length), generator=gen)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.dataset_size = max(table_rows, micro_batch * world)
        self.indices = torch.arange(rank * micro_batch, (rank + 1) * micro_batch)
        self.num_batches = 10**9

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        while True:
            yield self.images, self.tokens, self.indices

    def model_input(self, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (images.to(dtype=torch.float32) / 255.0).to(dtype)


def layout_config(
    cfg: ExperimentConfig, candidate: Candidate, output_dir: str, overrides: dict[str, Any] | None = None
) -> ExperimentConfig:
    """``cfg`` trained in ``candidate``'s layout: the same global batch, bounded micro-batch, its
    contrastive batch and checkpointing; no evaluation, no saving, output in ``output_dir``."""
    cfg = copy.deepcopy(cfg)
    cfg.train.global_batch = candidate.global_batch
    cfg.train.max_micro_batch = candidate.micro_batch
    cfg.train.batch_size = cfg.train.grad_accum_steps = None
    cfg.train.contrastive_batch = candidate.contrastive
    cfg.model.grad_checkpointing = candidate.grad_checkpointing
    cfg.train.output_dir = output_dir
    cfg.train.steps, cfg.train.save_every_steps, cfg.train.save_every_minutes = 10**6, 0, 0.0
    cfg.train.log_every_steps = 10**6
    cfg.optim.warmup_steps = min(cfg.optim.warmup_steps, 10)
    cfg.eval.zeroshot_dir = cfg.eval.retrieval_shards = cfg.eval.imagenet_val = None
    cfg.eval.every_steps = 0
    for key, value in (overrides or {}).items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


@contextlib.contextmanager
def quiet_set_up():
    """Each probe builds a Trainer: keep its start-up lines (layout, kernels, precision, DeepSpeed's
    notes) out of the console; warnings about the layout are the tune's own to report."""
    names = ("eva_fastclip.engine", "eva_fastclip.models", "DeepSpeed", "deepspeed", "")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def model_probe(
    cfg: ExperimentConfig,
    ds: dict[str, Any],
    candidate: Candidate,
    *,
    image_shape,
    context_length: int,
    output_dir: str,
    limit: int | None,
    watchdog=None,
    steps: int = PROBE_STEPS,
    table_rows: int = 0,
) -> ProbeResult:
    """Train ``candidate`` for ``1 + steps`` optimizer steps on synthetic batches; every rank calls it."""
    from eva_fastclip.engine.build import build_trainer

    device = _device()
    rank = dist.get_rank() if dist.is_initialized() else 0
    probe_cfg = layout_config(cfg, candidate, output_dir)
    tracker = StorageTracker(keep_peak_tensors=False, limit=limit) if device.type == "cpu" else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times: list[float] = []
    oom, detail, trainer, batches, metrics = False, "", None, None, None
    try:
        with quiet_set_up(), tracker or contextlib.nullcontext():
            batches = SyntheticBatches(candidate.micro_batch, image_shape, context_length, rank, table_rows)
            trainer = build_trainer(
                probe_cfg, at_stage(ds, candidate.zero_stage), loader=batches, watchdog=watchdog
            )
            for step in range(1 + steps):
                start = time.perf_counter()
                for _ in range(candidate.grad_accum_steps):
                    metrics = trainer.train_step(batches.images, batches.tokens, batches.indices)
                trainer.step += 1
                if metrics is None:
                    raise RuntimeError(f"{candidate.name()}: no optimizer step after its micro-batches")
                if step > 0:
                    times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError as err:
        oom, detail = True, str(err).splitlines()[0][:300]
    finally:
        _release(trainer)
        trainer = batches = metrics = None
        _collect()  # after the last reference here is gone
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
        _check_usable(device, candidate)
    else:
        peak = tracker.peak
    median = statistics.median(times) if times else 0.0
    flags = torch.tensor([float(oom), float(peak), median], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:  # agreed: one rank's OOM fails all
        flags = flags.to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # and the largest peak, the slowest rank's step
        flags = flags.cpu()
    failed = bool(flags[0] > 0)
    return ProbeResult(None if failed else int(flags[1]), None if failed else float(flags[2]), failed, detail)


def _release(trainer) -> None:
    """Free what a probe held: DeepSpeed's gradient hooks keep an engine alive until ``destroy`` (a probe
    that failed while the Trainer was being built leaves its engine to be found). The caller drops its
    reference and collects."""
    engines = [trainer.engine] if trainer is not None and hasattr(trainer, "engine") else _stray_engines()
    if trainer is not None and getattr(trainer, "writer", None) is not None:
        trainer.writer.close()
    for engine in engines:
        with contextlib.suppress(Exception):
            engine.destroy()


def _collect() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _stray_engines() -> list:
    from deepspeed.runtime.engine import DeepSpeedEngine

    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, DeepSpeedEngine)]


def _check_usable(device: torch.device, candidate: Candidate) -> None:
    try:
        torch.ones(1, device=device).add_(1).item()
        torch.cuda.synchronize(device)
    except RuntimeError as err:  # an OOM that corrupted the context, a sticky CUDA error
        raise DeviceUnusable(
            f"the GPU is unusable after the probe of {candidate.name()} ({err}); the trials so far are "
            "saved: run tune again, it goes on after them in a fresh process"
        ) from err


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: optimizer steps of a data probe after its first (which starts the loader and is not counted)
DATA_STEPS = 6


@dataclasses.dataclass
class DataResult:
    workers: int
    image_decode: str
    data_wait: float  # the slowest rank's fraction of step time spent waiting for the loader
    samples_per_s: float  # end to end, all ranks
    step_s: float


def data_probe(
    cfg: ExperimentConfig,
    ds: dict[str, Any],
    candidate: Candidate,
    *,
    workers: int,
    image_decode: str,
    output_dir: str,
    watchdog=None,
    steps: int = DATA_STEPS,
) -> DataResult:
    """Train ``candidate`` on the real loader (``workers`` per rank, ``image_decode``) for ``1 + steps``
    optimizer steps, timing its waits as training does (reliability/data_wait.py); every rank calls it."""
    from eva_fastclip.engine.build import build_trainer
    from eva_fastclip.reliability.data_wait import DataWait, cores_per_rank, slowest_rank

    overrides = {"data.workers": workers, "data.image_decode": image_decode}
    probe_cfg = layout_config(cfg, candidate, output_dir, overrides)
    trainer = None
    try:
        with quiet_set_up():
            trainer = build_trainer(probe_cfg, at_stage(ds, candidate.zero_stage), watchdog=watchdog)
        world = trainer.world_size
        data_wait = DataWait(workers, trainer.layout.per_rank, world, cores=cores_per_rank())
        done = 0
        while done < 1 + steps:
            for images, tokens, indices, *keys in data_wait.batches(trainer._epoch_batches):
                if trainer.train_step(images, tokens, indices, *keys) is None:
                    continue
                data_wait.step_ended()
                done += 1
                if done == 1:  # the first step warms the loader's shuffle buffers and the kernels
                    data_wait.end_window()
                if done == 1 + steps:
                    break
            else:
                trainer.epoch, trainer.micro_in_epoch = trainer.epoch + 1, 0
        window, _ = slowest_rank(data_wait.end_window(), trainer.device)
        metrics = data_wait.metrics(window)
    finally:
        _release(trainer)
        trainer = None
        _collect()
    return DataResult(
        workers,
        image_decode,
        metrics["perf/data_wait_fraction"],
        metrics["perf/samples_per_second"],
        metrics["perf/step_seconds"],
    )
