"""The training loop: set-up in a fixed order, then ``train()`` over ``train_step()``.

Set-up order: config (validated before we get here) → seed → pre-flight checks of paths (rank 0,
plan/preflight.py) → process group (reliability/process.py; the hang watchdog's heartbeats start) → the
checkpoint to resume (its conversion for another number of ranks, the accumulation that keeps its global
batch) → model (temperature controller, kernels) → data → its schedule checks → loss → precision and
DeepSpeed JSON → engine → the step's loss evaluations (engine/contrastive_step.py: per micro-batch, or
cached over the whole step) → resume (the RNG states last) → TensorBoard writer and step log. One "step" is
one optimizer step (``train.grad_accum_steps`` micro-batches). Each logging window compares the ranks' own
work (reliability/stragglers.py) and their data wait (reliability/data_wait.py) in one all-gather.

``train()`` catches the signals that ask for a stop and saves at the next step boundary
(reliability/preemption.py); the command line runs it under the hang watchdog (reliability/watchdog.py), whose
phases the trainer names. It stops after ``train.max_skipped_steps`` steps in a row that DeepSpeed skipped or
whose loss was not finite, and never saves non-finite weights: the last complete checkpoint stays the one to
resume.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eva_fastclip.checkpointing import checkpoint, resume_config
from eva_fastclip.config import ConfigError, ExperimentConfig, gamma_decay_epochs_for
from eva_fastclip.data import TrainLoader
from eva_fastclip.data.sample_keys import keys_for_indices
from eva_fastclip.engine.contrastive_step import (
    CachedStep,
    MicroBatch,
    MicroBatchStep,
    held_memory,
    running_statistics,
)
from eva_fastclip.engine.evaluate import evaluate_model, format_results
from eva_fastclip.engine.setup import initialize_engine
from eva_fastclip.losses import Gatherer, build_loss
from eva_fastclip.models import create_model
from eva_fastclip.models.kernels import configure_kernels
from eva_fastclip.models.masking import set_patch_dropout
from eva_fastclip.optim.param_groups import TEMPERATURE_GROUP
from eva_fastclip.optim.schedule import WarmupCosine, retarget_schedule
from eva_fastclip.optim.temperature import TemperatureController
from eva_fastclip.plan import preflight
from eva_fastclip.plan.deepspeed_json import autocast_dtype, resolve_deepspeed_config, resolve_precision
from eva_fastclip.plan.layout import batch_layout
from eva_fastclip.plan.precision import (
    common_hardware,
    detect_hardware,
    for_resume,
    precision_in_deepspeed_json,
)
from eva_fastclip.reliability.data_wait import DataWait, cores_per_rank, slowest_rank
from eva_fastclip.reliability.preemption import PREEMPTED_EXIT_CODE, Preempted, Preemption
from eva_fastclip.reliability.process import (
    init_process_group,
    memory_in_use_gib,
    on_rank0,
    rng_state,
    seed_everything,
    set_rng_state,
)
from eva_fastclip.reliability.stragglers import ForwardTimer, Stragglers
from eva_fastclip.reliability.watchdog import Watchdog, flight_recorder_env

log = logging.getLogger(__name__)


class NonFiniteSteps(RuntimeError):
    """Too many optimizer steps in a row were skipped or not finite, or the weights are no longer finite;
    the message names the step and the last complete checkpoint. Every rank raises it at the same step."""


class Trainer:
    _skips_reported = 0  # skipped samples already reported on the console by this process
    bad_steps = 0  # optimizer steps in a row, up to the current one, that were skipped or not finite
    _finite_in_step: torch.Tensor | None = None  # whether every micro-batch of this step had a finite loss
    _losses_in_step: list[torch.Tensor] = []  # the losses of this step's micro-batches so far

    def __init__(
        self,
        cfg: ExperimentConfig,
        ds_config: dict[str, Any],
        resume: str | None = None,
        loader=None,
        watchdog: Watchdog | None = None,
    ) -> None:
        """``loader`` replaces the webdataset loader (benchmarks, tests): an iterable of (images, tokens,
        indices) with ``num_batches`` and ``set_epoch``; a resumed epoch reads and drops the batches done
        unless it also has TrainLoader's ``state_dict`` and ``resume``. ``watchdog``: the hang watchdog
        the trainer tells what it does (``eva-fastclip train`` runs one; reliability/watchdog.py)."""
        self.cfg = cfg
        self.watchdog = watchdog or Watchdog(0, 0)  # (off)
        seed_everything(cfg.train.seed)
        if int(os.environ.get("RANK", "0")) == 0:  # before joining the group: a bad path stops the run now
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
            report = preflight.check_run(
                cfg, world_size, resume=resume, train_shards=loader is None, sizes=False
            )
            preflight.raise_for_errors(report.problems)
        if torch.cuda.is_available():  # PyTorch's Flight Recorder on for NCCL, a user's settings first
            for key, value in flight_recorder_env(Path(cfg.train.output_dir) / "flight_recorder").items():
                os.environ.setdefault(key, value)
        self.rank, self.world_size, self.device = init_process_group()
        self.watchdog.rank, self.watchdog.world_size = self.rank, self.world_size
        self.watchdog.connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self.is_main = self.rank == 0
        self.output_dir = Path(cfg.train.output_dir)
        self.checkpoint_root = self.output_dir / "checkpoints"
        self.resume_from = self._plan_resume(resume)  # may change train.grad_accum_steps: before the layout

        bundle = create_model(cfg.model, temperature_init=cfg.loss.temperature_init)
        self.temperature = TemperatureController.from_config(cfg.loss)
        bundle.model.logit_scale.requires_grad_(self.temperature.learns_global)
        self.bundle = bundle
        kernels = configure_kernels(bundle.model, self.device)  # swaps modules: before the optimizer exists
        if self.is_main:
            log.info(kernels.summary())

        layout = batch_layout(cfg, self.world_size)
        if self.is_main:
            log.info("batch: %s", layout.describe())
            for warning in layout.warnings():
                log.warning(warning)
        # the shards' records are read once, by rank 0 (minutes for LAION-400M without data.index_size),
        # and every rank's loader is handed the sizes, each shard's count included
        sizes = None if loader is not None else on_rank0(lambda: preflight.data_sizes(cfg))
        self.loader = loader or TrainLoader(
            cfg.data.train_shards,
            preprocess=bundle.preprocess_train,
            tokenize=bundle.tokenizer,
            batch_size=layout.micro_batch,
            rank=self.rank,
            world_size=self.world_size,
            seed=cfg.train.seed,
            resampled=cfg.data.resampled,
            weights=cfg.data.train_weights,
            num_samples=cfg.data.num_samples,
            index_size=cfg.data.index_size,
            # only per-sample state needs indices: the OpenCLIP loss trains on samples without one
            needs_index=preflight.needs_index(cfg),
            shuffle_buffer=cfg.data.shuffle_buffer,
            workers=cfg.data.workers,
            index_key=cfg.data.index_key,
            sizes=sizes,
            decode_device=self.device if cfg.data.image_decode == "gpu" else None,
            pin_memory=self.device.type == "cuda",
            accumulation=layout.grad_accum_steps,
        )
        schedule = preflight.check_schedule(cfg, self.loader.num_batches, world_size=self.world_size)
        preflight.raise_for_errors(schedule, log_warnings=self.is_main)
        self.steps_per_epoch = self.loader.num_batches // layout.grad_accum_steps
        self.total_steps = cfg.train.steps or cfg.train.epochs * self.steps_per_epoch
        self.layout = layout
        if cfg.loss.name != "openclip" and cfg.loss.gamma_decay_epochs is None:
            # train.steps sets the run's length: as many epochs as its micro-batches take
            epochs = math.ceil(self.total_steps * layout.grad_accum_steps / self.loader.num_batches)
            cfg.loss.gamma_decay_epochs = horizon = gamma_decay_epochs_for(epochs)
            if self.is_main:
                log.info("gamma decays over %d epochs, half of the run's %d", horizon, epochs)
        self.loss = build_loss(
            cfg.loss,
            gatherer=Gatherer.from_process_group(),
            dataset_size=self.loader.dataset_size,
            temperature=self.temperature,
        )

        hardware = common_hardware(detect_hardware())
        source = cfg.train.deepspeed_config
        precision = resolve_precision(cfg, ds_config, source=source, hardware=hardware)
        if self.resume_from is not None:  # a run goes on in the precision it was trained in
            explicit = (
                cfg.train.precision != "auto" or precision_in_deepspeed_json(ds_config, source) != "auto"
            )
            folder = self.resume_from[0]
            saved = checkpoint.saved_precision(folder)
            precision = for_resume(precision, saved, explicit=explicit, checkpoint=str(folder))
        if self.is_main:
            log.info("precision: %s (%s)", precision.name, precision.reason)
            if precision.warning:
                log.warning(precision.warning)
        ds = resolve_deepspeed_config(ds_config, cfg, layout, source=source, precision=precision)
        self.deepspeed_settings = resume_config.deepspeed_settings(ds)
        self._resume_changes: list[resume_config.Change] = []
        if self.resume_from is not None:  # what cannot change stops the run here, before the engine
            folder = self.resume_from[0]
            saved = checkpoint.saved_settings(folder)
            new = {"config": cfg.to_dict(), "deepspeed": self.deepspeed_settings}
            self._resume_changes = resume_config.compare(saved, new)
            resume_config.refuse(self._resume_changes, str(folder))
        self.input_dtype = autocast_dtype(ds)
        if self.resume_from is not None and self.resume_from[1] is not None:
            ds["checkpoint"] = {**ds.get("checkpoint", {}), "load_universal": True}
        self.engine = initialize_engine(
            bundle.model, cfg, ds, self.total_steps, temperature_lr=self.temperature.own_group_lr
        )

        # BatchNorm's running statistics (RN towers), and their values before the step under way
        self._running_stats = running_statistics(self.engine.module)
        self._running_stats_before: list[torch.Tensor] | None = None
        self.contrastive_step = self._contrastive_step(layout)
        self.contrastive_step.note = self.watchdog.set_phase
        self.forward_timer = ForwardTimer(self.device)  # the rank's own work, against the others'
        self.contrastive_step.timed = self.forward_timer
        self.stragglers = Stragglers(cfg.train.straggler_factor, cfg.train.straggler_windows)
        self.watchdog.describe = self._hang_detail
        self.step, self.epoch, self.micro_in_epoch = 0, 0, 0
        self.unmasked = False
        self._saved_step: int | None = None  # the step whose state this run saved (or resumed, unchanged)
        self._saved_at = time.monotonic()  # when that was (train.save_every_minutes counts from there)
        self.preemption: Preemption | None = None  # while train() runs: a stop asked for
        self._loader_position: dict[str, Any] | None = None  # the resumed epoch's data position
        if self.resume_from is not None:
            folder, universal = self.resume_from
            built = resume_config.optimizer_settings(self.engine.lr_scheduler)  # from this run's config
            state = checkpoint.load_checkpoint(self.engine, folder, universal)
            self._restore(state, folder, universal, built)
        self._after_applied_step()  # the first step's temperature lr follows tau too (rgcl_g)

        self.writer = None
        if self.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.output_dir / "tensorboard"))
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
            self._step_log = open_step_log(self.output_dir / STEP_LOG, self.step)
            # a finished run resumed evaluates its last step again: that step's line is replaced
            finished = self.step >= self.total_steps
            self._eval_log = open_step_log(self.output_dir / EVAL_LOG, self.step - finished)
        self._evaluated: dict[str, Any] | None = None  # this process's latest evaluation, with its step

    # ---- the loop ------------------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        """Train to the end; a stop asked for (a signal, the launcher's end) saves and raises Preempted."""
        self._saved_at = time.monotonic()  # train.save_every_minutes counts from training's start
        with Preemption(self.cfg.train.preempt_signal) as self.preemption:
            return self._train()

    def _train(self) -> dict[str, float]:
        cfg = self.cfg.train
        progress = self._progress_bar()
        data_wait = DataWait(
            self.cfg.data.workers, self.layout.per_rank, self.world_size, cores=cores_per_rank()
        )
        shown: dict[str, str] = {}  # the progress bar's last data wait fraction
        while self.step < self.total_steps:
            for images, tokens, indices, *keys in self._watched(data_wait.batches(self._epoch_batches)):
                self._maybe_unmask()
                metrics = self.train_step(images, tokens, indices, *keys)
                if metrics is None:  # accumulating: no optimizer step yet
                    continue
                data_wait.step_ended()  # after train_step read the loss: the device finished the step
                self.step += 1
                stop, save_now = self._agree(metrics)  # raises NonFiniteSteps after train.max_skipped_steps
                progress.update(1)
                progress.set_postfix(loss=f"{metrics['loss']:.3f}", **shown, refresh=False)
                self._log_step(metrics)
                if stop:
                    self._stop_preempted()  # saves, raises Preempted
                if self.step % cfg.log_every_steps == 0 or self.step == self.total_steps:
                    metrics.update(self._skipped_samples())  # a collective: every rank logs at this step
                    perf = self._perf_window(data_wait)  # a collective too
                    if "perf/data_wait_fraction" in perf:
                        shown = {"data": f"{perf['perf/data_wait_fraction']:.0%}"}
                    self._log(metrics)
                    self._log(perf, prefix="")
                if self.cfg.eval.every_steps and self.step % self.cfg.eval.every_steps == 0:
                    self.evaluate()
                if save_now or (cfg.save_every_steps and self.step % cfg.save_every_steps == 0):
                    self.save()
                if self.step >= self.total_steps:
                    break
            else:  # the epoch ran to its end
                self.epoch, self.micro_in_epoch = self.epoch + 1, 0
        progress.close()
        self.watchdog.set_phase("finish", self.step)
        if self._saved_step != self.step:  # even over a checkpoint of this step that an earlier run left
            self.save()
        return self.evaluate(final=True)

    def _watched(self, batches):
        """The loop's micro-batches, the watchdog told whenever the rank waits for one."""
        iterator = iter(batches)
        while True:
            self.watchdog.set_phase("loader", self.step)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch

    def _hang_detail(self) -> str:
        """For a hang's report: the last collective the loss entered, the loader's workers."""
        last, workers = getattr(self.loss.gatherer, "last", None), getattr(self.loader, "worker_pids", None)
        parts = [f"the last collective its loss entered: {last}"] if last else []
        if workers:
            parts.append(f"its training loader's workers: pids {', '.join(map(str, workers))}")
        return "; ".join(parts)

    def train_step(self, images, tokens, indices, keys=None) -> dict[str, float] | None:
        """One micro-batch; returns metrics when it completed an optimizer step, else None. ``keys``: the
        samples' keys (TrainLoader's), which pick their token masks; a loader without them gets the keys
        TrainLoader would give the same indices (data/sample_keys.py)."""
        engine = self.engine
        if self._running_stats_before is None:  # the step's first micro-batch
            self._running_stats_before = [b.clone() for b in self._running_stats]
        if keys is None:
            keys = keys_for_indices(self.cfg.train.seed, self.epoch, indices)
        if hasattr(self.loader, "onto_device"):  # decoded there, normalised at the forward (TrainLoader)
            images = self.loader.onto_device(images, self.device)
        else:
            images = images.to(self.device, non_blocking=True)
        batch = MicroBatch(
            images, tokens.to(self.device, non_blocking=True), indices.to(self.device), keys.to(self.device)
        )
        outs, boundary = self.contrastive_step.add(batch)  # forward(s), loss, backward, engine.step
        for out in outs:
            finite = torch.isfinite(out.loss.detach())  # no sync here: read once per optimizer step
            self._finite_in_step = finite if self._finite_in_step is None else self._finite_in_step & finite
            self._losses_in_step = [*self._losses_in_step, out.loss.detach()]
        self.micro_in_epoch += 1
        if not boundary:
            return None
        loss_finite, self._finite_in_step = bool(self._finite_in_step), None
        # the step's loss: the mean over its micro-batches (each one's share of the global batch is equal)
        step_loss, self._losses_in_step = torch.stack(self._losses_in_step).mean().item(), []
        # DeepSpeed's global_steps advances even on a skipped step: ask whether it was really applied
        if engine.was_step_applied():
            self.loss.on_step_applied()
            self._after_applied_step()
        else:
            self.loss.on_step_skipped()
        return {
            **outs[-1].metrics,
            "loss": step_loss,
            "step_applied": float(engine.was_step_applied()),
            "loss_finite": float(loss_finite),
        }

    # ---- pieces --------------------------------------------------------------------------------------

    def _contrastive_step(self, layout):
        """What each loss evaluation sees (train.contrastive_batch, engine/contrastive_step.py); one
        micro-batch a step sees the whole step either way."""
        if layout.contrastive == "micro" or layout.grad_accum_steps == 1:
            return MicroBatchStep(self.engine, self.loss, self._model_input)
        if self.is_main:  # uint8 from open_clip's transform in TrainLoader, else floats
            image_bytes = 1 if getattr(self.loader, "image_transform", None) is not None else 4
            log.info(held_memory(layout, self.bundle.embed_dim, self.bundle.image_shape, image_bytes))
        return CachedStep(self.engine, self.loss, self._model_input, layout.grad_accum_steps)

    def _model_input(self, images: torch.Tensor) -> torch.Tensor:
        """A micro-batch's images on the device as the model takes them (normalised, its precision)."""
        if hasattr(self.loader, "model_input"):
            return self.loader.model_input(images, self.input_dtype)
        return images.to(dtype=self.input_dtype)

    def _maybe_unmask(self) -> None:
        """EVA-CLIP's unmasked final phase: the last ``model.unmasked_final_steps`` steps see all patches."""
        final = self.cfg.model.unmasked_final_steps
        if final and not self.unmasked and self.step >= self.total_steps - final:
            count = set_patch_dropout(self.engine.module, 0.0)
            self.unmasked = True
            if self.is_main:
                log.info(
                    "step %d: patch dropout off for the last %d steps (%d modules)", self.step, final, count
                )

    def _after_applied_step(self) -> None:
        """The temperature controller's turn: clamp the global tau, set rgcl_g's lr for the next step."""
        if not self.temperature.learns_global:
            return
        param = self.bundle.model.logit_scale
        groups = [g for g in self.engine.optimizer.param_groups if g.get("name") == "temperature"]
        scheduler = self.engine.lr_scheduler

        def set_group_lr(lr: float) -> None:  # the schedule multiplies base_lrs: change the base
            for i, group in enumerate(self.engine.optimizer.param_groups):
                if group.get("name") == "temperature":
                    scheduler.base_lrs[i] = lr
                    group["lr"] = lr

        self.temperature.after_applied_step(
            read_full_parameter(param).item(),
            lambda theta: write_full_parameter_(param, theta),
            set_group_lr if groups else None,
        )

    def _agree(self, metrics: dict[str, float]) -> tuple[bool, bool]:
        """The step boundary's one collective, a MAX over ranks of: this step was bad (below), a stop was
        asked for (reliability/preemption.py: one rank may have the signal), rank 0's clock says save
        (train.save_every_minutes: every rank saves at the same step). Returns (stop, save now)."""
        bad = not (metrics["step_applied"] and metrics["loss_finite"])
        stop = self.preemption is not None and self.preemption.requested is not None
        minutes = self.cfg.train.save_every_minutes
        due = self.is_main and minutes > 0 and time.monotonic() - self._saved_at >= minutes * 60
        flags = torch.tensor([float(bad), float(stop), float(due)], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, stop, due = (bool(flag) for flag in flags.tolist())
        if self.preemption is not None:
            self.preemption.step_ended()
        self._count_bad_steps(bad, metrics)
        return stop, due

    def _stop_preempted(self) -> None:
        """Save this step's checkpoint (unless there is one) and raise Preempted (reliability/
        preemption.py)."""
        what = self.preemption.requested or "another rank was asked to stop"
        started = time.monotonic()
        if self._saved_step != self.step:
            self.save()
        seconds, folder = (
            time.monotonic() - started,
            self.checkpoint_root / checkpoint.tag_for_step(self.step),
        )
        raise Preempted(
            f"step {self.step}: {what}; checkpoint {folder} complete after {seconds:.1f} s: resume with "
            f"--resume latest (exit code {PREEMPTED_EXIT_CODE})"
        )

    def _count_bad_steps(self, bad: bool, metrics: dict[str, float]) -> None:
        """Count the optimizer steps in a row that DeepSpeed skipped (non-finite gradients: ZeRO, bf16's
        check, fp16's scaler) or whose loss was not finite (applied anyway: fp32 without ZeRO), and stop
        after ``train.max_skipped_steps`` of them. One rank's loss may be finite where another's is not, so
        ``bad`` is the verdict over ranks (``_agree``): every rank stops at the same step."""
        self.bad_steps = self.bad_steps + 1 if bad else 0
        before, self._running_stats_before = self._running_stats_before, None
        if self.bad_steps:
            # the forward passes updated BatchNorm's running statistics from the non-finite batch even
            # where the step was skipped; NaN there never leaves (mean <- m*mean + (1-m)*x) and rank 0's
            # are saved: a bad step leaves none of its trace
            for buffer, saved in zip(self._running_stats, before or (), strict=True):
                buffer.copy_(saved)
        metrics["skipped_in_a_row"] = float(self.bad_steps)
        if not self.bad_steps:
            return
        limit = self.cfg.train.max_skipped_steps
        if self.is_main:
            why = "non-finite loss" if metrics["step_applied"] else "skipped (non-finite gradients)"
            log.warning(
                "step %d: %s; %d such step(s) in a row (train.max_skipped_steps=%d%s)",
                self.step,
                why,
                self.bad_steps,
                limit,
                "" if limit else ": the run never stops for them",
            )
        if limit and self.bad_steps >= limit:
            first = self.step - self.bad_steps + 1
            self._stop(
                f"{self.bad_steps} optimizer steps in a row (steps {first}-{self.step}) were skipped for "
                f"non-finite gradients or had a non-finite loss (train.max_skipped_steps={limit})"
            )

    def _stop(self, what: str) -> None:
        """Raise NonFiniteSteps naming the step and the checkpoint to resume from; nothing is saved."""
        found = checkpoint.complete_checkpoints(self.checkpoint_root)
        if found:
            last = (
                f"the last complete checkpoint, {found[-1]}, is intact: resume from it with --resume latest"
            )
        else:
            last = f"there is no complete checkpoint under {self.checkpoint_root} yet: start again"
        raise NonFiniteSteps(
            f"step {self.step}: {what}. The run stops without saving; {last} once the cause is found (the "
            "data of those steps, the lr, the precision). train.max_skipped_steps=0 never stops for "
            "skipped steps."
        )

    def _weights_finite(self) -> bool:
        """Whether every weight and BatchNorm statistic is finite, on every rank (the verdict is reduced:
        the statistics are each rank's own, and rank 0's are saved). Not every buffer: the text tower's
        causal attention mask holds -inf by design."""
        stats = (b for b in self._running_stats if b.is_floating_point())
        tensors = [*self.engine.module.parameters(), *stats]
        finite = torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all().float()
        if self.world_size > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def _epoch_batches(self):
        """This epoch's remaining micro-batches. A resumed epoch goes on in the same order after the
        micro-batches its checkpoint's run had taken: TrainLoader.resume rebuilds its streams there (exactly
        with this rank's saved position, else approximately: docs/data.md); a stand-in loader is read from the
        epoch's start and the taken batches dropped."""
        start, position, self._loader_position = self.micro_in_epoch, self._loader_position, None
        self.loss.set_epoch(self.epoch)
        if start == 0:
            self.loader.set_epoch(self.epoch)
            return iter(self.loader)
        if not hasattr(self.loader, "resume"):
            self.loader.set_epoch(self.epoch)
            return itertools.islice(self.loader, start, None)
        if not self.loader.resume(self.epoch, start, position) and self.is_main:
            log.warning(
                "epoch %d goes on after micro-batch %d on another layout (ranks, loader workers, batch) than "
                "its checkpoint's: approximately, some samples of the epoch may be seen twice or not at all "
                "(docs/data.md, Resuming an epoch)",
                self.epoch,
                start,
            )
        return iter(self.loader)

    def save(self) -> Path:
        """A checkpoint of this step: DeepSpeed's files, our client state, and each rank's own files
        (per-sample state; RNG states and data position)."""
        # after non-finite steps that were applied (fp32 without ZeRO) the weights may be NaN: never save
        # those, which would also delete an older good checkpoint (train.keep_checkpoints)
        if self.bad_steps and not self._weights_finite():
            self._stop(f"the weights are no longer finite after {self.bad_steps} non-finite step(s) in a row")
        started = time.monotonic()
        state = {
            "step": self.step,
            "epoch": self.epoch,
            "micro_in_epoch": self.micro_in_epoch,
            "world_size": self.world_size,
            "layout": {
                "micro_batch": self.layout.micro_batch,
                "grad_accum_steps": self.layout.grad_accum_steps,
                "precision": precision_of(self.engine),
            },
            "config": self.cfg.to_dict(),
            "temperature": self.temperature.state_dict(),
        }

        def write_extra(folder: Path) -> None:
            self.loss.save_state(folder / "per_sample")
            position = self.loader.state_dict() if hasattr(self.loader, "state_dict") else None
            checkpoint.save_rank_state(folder, self.rank, {"rng": rng_state(), "loader": position})

        with self.watchdog.phase("save"):
            folder = checkpoint.save_checkpoint(
                self.engine,
                self.checkpoint_root,
                self.step,
                state,
                keep=self.cfg.train.keep_checkpoints,
                write_extra=write_extra,
                marker={
                    "global_batch": self.layout.global_batch,
                    "micro_batch": self.layout.micro_batch,
                    "grad_accum_steps": self.layout.grad_accum_steps,
                    "precision": precision_of(self.engine),
                    # what a resumed run compares its own config with before it builds anything
                    "config": state["config"],
                    "deepspeed": self.deepspeed_settings,
                },
            )
        self._saved_step, self._saved_at = self.step, time.monotonic()
        if self.is_main:
            log.info("saved checkpoint %s", folder)
            budget = self.preemption.save_took(self._saved_at - started) if self.preemption else None
            if budget:
                log.log(logging.WARNING if "more than" in budget else logging.INFO, "%s", budget)
        if self.preemption is not None:
            self.preemption.mark()  # the next step's time leaves the save out
        return folder

    def _plan_resume(self, resume: str | None) -> tuple[Path, Path | None] | None:
        """The checkpoint to resume from and, if it was saved by another number of ranks, its universal
        conversion (made beside it once, by rank 0); then train.grad_accum_steps keeps its global batch.
        Rank 0 decides, after finishing what a crash interrupted, and tells the others."""
        if resume is None:
            return None
        root = self.checkpoint_root

        def choose() -> Path | None:
            checkpoint.recover(root)
            return checkpoint.resolve_resume(resume, root)

        folder = on_rank0(choose)
        if folder is None:
            if self.is_main:
                log.info("no complete checkpoint under %s yet: starting from scratch", root)
            return None
        marker = checkpoint.read_marker(folder)
        if marker["world_size"] != self.world_size:
            self._keep_global_batch(folder, marker)
        if not checkpoint.needs_conversion(folder, self.world_size):
            return folder, None
        return folder, on_rank0(lambda: checkpoint.convert_to_universal(folder))

    def _keep_global_batch(self, folder: Path, marker: dict[str, Any]) -> None:
        """On another number of ranks, keep the checkpoint's global batch: with train.global_batch the
        layout keeps it already (a changed value is the user's choice); else train.grad_accum_steps
        changes (config.batch_layout, which refuses what cannot make it)."""
        saved, ranks, train = marker.get("global_batch"), self.world_size, self.cfg.train
        if saved is None:
            return
        try:
            layout = batch_layout(self.cfg, ranks, resumed_global=saved)
        except ConfigError as err:
            raise ConfigError(f"{folder} was saved by {marker['world_size']} ranks: {err}") from None
        if train.global_batch is None:
            before, train.grad_accum_steps = train.grad_accum_steps, layout.grad_accum_steps
        if not self.is_main:
            return
        if train.global_batch is not None and layout.global_batch != saved:
            log.info(
                "%s was saved with a global batch of %d; train.global_batch=%d applies from here",
                folder,
                saved,
                layout.global_batch,
            )
        elif train.global_batch is None and layout.grad_accum_steps != before:
            log.info(
                "%s was saved by %d ranks: its global batch of %d is kept on %d ranks with "
                "train.grad_accum_steps=%d (was %d)",
                folder,
                marker["world_size"],
                saved,
                ranks,
                layout.grad_accum_steps,
                before,
            )

    def _restore(
        self, state: dict[str, Any], folder: Path, universal: Path | None, built: list[dict[str, Any]]
    ) -> None:
        """Everything of the checkpoint that DeepSpeed does not load: position, temperature controller,
        per-sample state, the schedule's new length, and (saved by as many ranks) this rank's RNG states
        and data position; the RNG states last, when nothing else draws before the first step. Then the
        optimizer settings of this run's config (``built`` before the load) replace the checkpoint's."""
        self.step, self.epoch, self.micro_in_epoch = state["step"], state["epoch"], state["micro_in_epoch"]
        self.temperature.load_state_dict(state.get("temperature", {}))
        self.loss.load_state(folder / "per_sample")
        self._retarget_schedule()
        self._apply_resumed_config(built)
        saved = state.get("layout", {}).get("micro_batch", self.layout.micro_batch) * state["world_size"]
        if saved != self.layout.micro_batch * self.world_size:  # micro-batches of another size: same samples
            samples = self.micro_in_epoch * saved
            self.micro_in_epoch = min(samples // self.layout.samples_per_forward, self.loader.num_batches)
        own = checkpoint.load_rank_state(folder, self.rank) if universal is None else None
        # the checkpoint's state, unchanged: no save of this step replaces the folder it came from (converted
        # from another number of ranks, the original keeps every rank's files; its conversion is reused)
        self._saved_step = self.step
        same_ranks = checkpoint.read_marker(folder)["world_size"] == self.world_size
        # on another number of ranks every rank re-tiles the epoch's rest from the same position: rank 0's
        position = own if same_ranks else checkpoint.load_rank_state(folder, 0)
        self._loader_position = position["loader"] if position else None
        if hasattr(self.loader, "load_skipped"):  # train/data/skipped* go on from the checkpoint's
            self.loader.load_skipped(self._saved_skips(folder, own))
        if self.is_main:
            log.info("resumed from %s at step %d (epoch %d)", folder, self.step, self.epoch)
        if own is not None:
            set_rng_state(own["rng"])
        else:  # no state of this rank: fresh draws, different from the run's start and on every rank
            seed_everything(zlib.crc32(f"{self.cfg.train.seed}:{self.step}:{self.rank}".encode()))

    def _saved_skips(self, folder: Path, own: dict[str, Any] | None) -> dict[str, int]:
        """This rank's part of the checkpoint's skipped-sample counts (they are logged summed over ranks):
        its own on as many ranks; on another number, rank 0 takes the sum of every saved rank's."""
        saved_ranks = checkpoint.read_marker(folder)["world_size"]
        if saved_ranks == self.world_size:
            return ((own or {}).get("loader") or {}).get("skipped", {})
        total: dict[str, int] = {}
        for rank in range(saved_ranks if self.is_main else 0):
            saved = (checkpoint.load_rank_state(folder, rank) or {}).get("loader") or {}
            for reason, count in saved.get("skipped", {}).items():
                total[reason] = total.get(reason, 0) + count
        return total

    def _retarget_schedule(self) -> None:
        """Stretch the lr decay over a changed train.steps / train.epochs (setup.WarmupCosine), and end it
        at this run's optim.min_lr_ratio (the warm-up cannot change: checkpointing/resume_config.py)."""
        scheduler = self.engine.lr_scheduler
        saved = retarget_schedule(scheduler, self.step, self.total_steps)
        if saved is None:
            return
        for fn in scheduler.lr_lambdas:
            if isinstance(fn, WarmupCosine):
                fn.min_ratio = self.cfg.optim.min_lr_ratio  # from the cosine's current point on
        if not self.is_main:
            return
        if saved.warmup != self.cfg.optim.warmup_steps:  # a checkpoint that kept no config to compare
            log.warning(
                "the checkpoint's warm-up of %d steps goes on (optim.warmup_steps=%d is for new runs)",
                saved.warmup,
                self.cfg.optim.warmup_steps,
            )
        if saved.total == self.total_steps:
            return
        log.info(
            "the run's length changed from %d to %d steps: the rest of the lr decay is stretched over it",
            saved.total,
            self.total_steps,
        )
        if self.step >= saved.warmup and saved.progress(self.step) >= 1.0 and self.total_steps > self.step:
            log.warning(
                "the lr had finished its decay at step %d: the %d steps added train at its final lr "
                "(optim.min_lr_ratio). To decay over the longer run, resume from a checkpoint saved before "
                "step %d",
                self.step,
                self.total_steps - self.step,
                saved.total,
            )

    def _apply_resumed_config(self, built: list[dict[str, Any]]) -> None:
        """The optimizer settings of this run's config in place of the checkpoint's (each group's peak lr,
        the temperature's after its one-time drop, weight decay, betas, eps), from the next step on; rank 0
        logs every key that changed (checkpointing/resume_config.py)."""
        scale = {}
        if self.temperature.lr_dropped:  # rgcl_g's drop happened: it stays on the new temperature lr
            scale[TEMPERATURE_GROUP] = self.temperature.lr_drop_factor
        resume_config.reapply_optimizer_settings(self.engine.lr_scheduler, built, scale)
        if self.is_main:
            for change in self._resume_changes:
                log.info("%s", change.message())

    def _log_step(self, metrics: dict[str, float]) -> None:
        """One line per optimizer step in output_dir/train_log.jsonl (rank 0): metrics and lr per tower."""
        if not self.is_main:
            return
        record: dict[str, Any] = {"step": self.step, "epoch": self.epoch}
        record.update((k, v) for k, v in metrics.items() if isinstance(v, (int, float)))
        for group in self.engine.optimizer.param_groups:
            key = f"lr/{group.get('name', 'group').split('.')[0]}"
            record[key] = max(record.get(key, 0.0), group["lr"])
        self._step_log.write(json.dumps(record) + "\n")
        self._step_log.flush()

    def evaluate(self, final: bool = False) -> dict[str, float]:
        """Every configured evaluation, on every rank with its share of the images (engine.module: the
        weights are whole on every rank under ZeRO stages 0-2); every rank must call it. Rank 0 appends
        {step, epoch, metrics} to eval_results.jsonl and logs TensorBoard's eval/*. Once per step: the
        final call reuses the results of an evaluation at this step."""
        eval_cfg = self.cfg.eval
        if self._evaluated is not None and self._evaluated["step"] == self.step:
            results = {k: v for k, v in self._evaluated.items() if k not in ("step", "epoch")}
        elif eval_cfg.zeroshot_dir or eval_cfg.imagenet_val or eval_cfg.retrieval_shards:
            with self.watchdog.phase("evaluation"):
                results = evaluate_model(
                    self.engine.module,
                    self.bundle,
                    eval_cfg,
                    device=self.device,
                    dtype=self.input_dtype,
                    collectives=Gatherer.from_process_group(),
                )
            self._evaluated = {"step": self.step, "epoch": self.epoch, **results}
            if self.is_main:
                self._eval_log.write(json.dumps(self._evaluated) + "\n")
                self._eval_log.flush()
                self._log({f"eval/{k}": v for k, v in results.items()}, prefix="")
        else:
            results = {}
        if final and results and self.is_main:
            print(format_results(results), flush=True)
            summary = {"step": self.step, **results}
            (self.output_dir / "final_metrics.json").write_text(json.dumps(summary, indent=2))
        if self.preemption is not None:
            self.preemption.mark()  # the next step's time leaves the evaluation out
        return results

    def _skipped_samples(self) -> dict[str, float]:
        """Samples the loaders skipped so far, summed over ranks, as metrics ``data/skipped`` (the total) and
        ``data/skipped/<reason>``; rank 0 prints a line whenever the total has grown. Every rank calls it."""
        by_reason = getattr(self.loader, "skipped_by_reason", None)
        if by_reason is None:  # a stand-in loader (benchmarks, tests) skips nothing
            return {}
        counts = torch.tensor(list(by_reason.values()), dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(counts)
        counts = dict(zip(by_reason, counts.tolist()))
        total = sum(counts.values())
        if self.is_main and total > self._skips_reported:
            why = ", ".join(f"{reason} {count}" for reason, count in counts.items() if count)
            log.warning(
                "step %d: %d samples skipped so far on %d rank(s) (%s); the loader's warnings name the first",
                self.step,
                total,
                self.world_size,
                why,
            )
            self._skips_reported = total
        return {"data/skipped": total, **{f"data/skipped/{reason}": n for reason, n in counts.items()}}

    def _perf_window(self, data_wait: DataWait) -> dict[str, float]:
        """The logging window's perf/* metrics with the slowest rank's data wait (MAX over ranks: it holds
        the others back) and the stragglers' figures; rank 0 warns when the loader held the steps back or
        a rank was behind the others. Every rank calls it (one all-gather)."""
        window, ranks = slowest_rank(data_wait.end_window(), self.device, self.forward_timer.take())
        step_seconds = window.wall / window.steps if window.steps else 0.0
        stragglers, named = self.stragglers.end_window(*ranks.T, window.steps, step_seconds, self.step)
        for warning in (data_wait.warning(window, self.step), named):
            if warning and self.is_main:
                log.warning(warning)
        return {**data_wait.metrics(window), **stragglers}

    def _log(self, metrics: dict[str, float], prefix: str = "train/") -> None:
        if not self.is_main:
            return
        if prefix == "train/":
            # one curve per tower (its largest lr: the head's), not one per layer group
            for group in self.engine.optimizer.param_groups:
                key = f"lr/{group.get('name', 'group').split('.')[0]}"
                metrics[key] = max(metrics.get(key, 0.0), group["lr"])
            metrics["memory_gib"] = memory_in_use_gib()
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(prefix + key, value, self.step)
        self.writer.flush()

    def _progress_bar(self):
        from tqdm import tqdm

        return tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=not self.is_main,
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )


# ---- the step log and the engine's parameters ----------------------------------------------------------


#: one line of metrics per optimizer step, in train.output_dir
STEP_LOG = "train_log.jsonl"
EVAL_LOG = "eval_results.jsonl"  # one line per evaluated step, kept as the step log is on resume


def open_step_log(path: Path, step: int):
    """The step log for appending, without the lines of steps after ``step``: a resumed run trains those
    again (they were its killed predecessor's) and a fresh run (step 0) starts an empty log."""
    if path.exists():
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):  # a line cut short by a kill
                continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return open(path, "a")


def precision_of(engine) -> str:
    """bf16, fp16 or fp32: the precision ``engine`` trains in."""
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


def read_full_parameter(param: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's fp32 value: ZeRO's master copy where there is one (a collective: all ranks call)."""
    from deepspeed.utils import safe_get_full_fp32_param

    master = safe_get_full_fp32_param(param)
    return param.detach().float() if master is None else master


def write_full_parameter_(param: torch.nn.Parameter, value: float) -> None:
    """Set a parameter everywhere it lives: ZeRO's fp32 master (owner's partition) and the module copy."""
    from deepspeed.utils import safe_set_full_fp32_param

    full = torch.full_like(read_full_parameter(param), value)
    safe_set_full_fp32_param(param, full)
    with torch.no_grad():
        param.fill_(value)
