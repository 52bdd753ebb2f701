"""The training loop: the Trainer wires the run's components together, then ``train()`` over ``train_step()``.

The Trainer decides nothing about the run: its plan (plan/run_plan.py) holds the layout, the precision,
the DeepSpeed JSON, the length and the checkpoint to resume, and engine/build.py sets up the process group
before it. It builds, in this order: model (temperature controller, kernels) → data → loss → engine
(engine/setup.py) → the step's loss evaluations (engine/contrastive_step.py: per micro-batch, or cached
over the whole step) → the fault layer's hooks (reliability/: bad steps, stragglers, data wait) → the
checkpointer (checkpointing/checkpointer.py), which restores a resumed run (the RNG states last) → the run's
logs (engine/run_log.py). One "step" is one optimizer step (``train.grad_accum_steps`` micro-batches).

Its own state is small: the step, the epoch and the micro-batches taken in it (:meth:`state_dict`).
``train()`` catches the signals that ask for a stop and saves at the next step boundary
(reliability/preemption.py), under the hang watchdog the command line runs (reliability/watchdog.py),
whose phases it names. Non-finite steps stop the run after ``train.max_skipped_steps`` of them in a row,
and non-finite weights are never saved (reliability/bad_steps.py). Each logging window compares the
ranks' own work (reliability/stragglers.py) and their data wait (reliability/data_wait.py) in one
all-gather, and logs the window's throughput: samples/s and model TFLOP/s per rank, MFU
(engine/throughput.py), which the step log's line of its last step and the run's end carry too.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from eva_fastclip.checkpointing.checkpointer import Checkpointer
from eva_fastclip.data import TrainLoader
from eva_fastclip.data.sample_keys import keys_for_indices
from eva_fastclip.engine.compiled import CompileWatch, compile_towers, eagerly
from eva_fastclip.engine.contrastive_step import (
    CachedStep,
    MicroBatch,
    MicroBatchStep,
    held_memory,
    running_statistics,
)
from eva_fastclip.engine.evaluate import EvalPrecision, evaluate_model, format_results, fp32_weights
from eva_fastclip.engine.run_log import RunLog
from eva_fastclip.engine.setup import initialize_engine, read_full_parameter, write_full_parameter_
from eva_fastclip.engine.step_batches import DataUnavailable, StepBatches
from eva_fastclip.engine.throughput import Throughput, throughput_of
from eva_fastclip.losses import Gatherer, build_loss
from eva_fastclip.models import create_model
from eva_fastclip.models.kernels import configure_kernels
from eva_fastclip.models.masking import set_patch_dropout
from eva_fastclip.optim.temperature import TemperatureController
from eva_fastclip.plan import preflight
from eva_fastclip.plan.deepspeed_json import autocast_dtype
from eva_fastclip.plan.run_plan import RunPlan
from eva_fastclip.reliability.bad_steps import BadSteps, NonFiniteSteps, agree
from eva_fastclip.reliability.data_wait import DataWait, cores_per_rank, slowest_rank
from eva_fastclip.reliability.preemption import PREEMPTED_EXIT_CODE, Preempted, Preemption
from eva_fastclip.reliability.process import Rank
from eva_fastclip.reliability.stragglers import ForwardTimer, Stragglers
from eva_fastclip.reliability.watchdog import Watchdog

log = logging.getLogger(__name__)


class Trainer:
    _finite_in_step: torch.Tensor | None = None  # whether every micro-batch of this step had a finite loss
    _losses_in_step: list[torch.Tensor] = []  # the losses of this step's micro-batches so far

    def __init__(self, plan: RunPlan, rank: Rank, *, loader=None, watchdog: Watchdog | None = None) -> None:
        """``loader`` replaces the webdataset loader (benchmarks, tests): an iterable of (images, tokens,
        indices) with ``num_batches`` and ``set_epoch``; a resumed epoch reads and drops the batches done
        unless it also has TrainLoader's ``state_dict`` and ``resume``. Build one with
        engine/build.py's ``build_trainer``, which makes the plan."""
        self.plan, self.cfg, self.layout = plan, plan.config, plan.layout
        self.rank, self.world_size, self.device = rank.rank, rank.world_size, rank.device
        self.is_main = rank.is_main
        self.watchdog = watchdog or Watchdog(0, 0)  # (off)
        self.output_dir = Path(self.cfg.train.output_dir)
        self.step, self.epoch, self.micro_in_epoch = 0, 0, 0
        self.unmasked = False  # EVA-CLIP's unmasked final phase has begun
        if self.is_main:
            plan.log_notes()
        self.bundle, self.temperature = self._build_model()
        self.loader = loader or self._build_loader()
        self.steps_per_epoch = self.loader.num_batches // self.layout.grad_accum_steps
        self.total_steps = plan.total_steps
        self.loss = build_loss(
            self.cfg.loss,
            gatherer=Gatherer.from_process_group(),
            dataset_size=self.loader.dataset_size,
            temperature=self.temperature,
        )
        self.input_dtype = autocast_dtype(plan.deepspeed)
        self.throughput = Throughput.for_run(
            self.cfg, self.layout.per_rank, self.device, plan.precision.name, count=self.is_main
        )
        if self.is_main:
            log.info(self.throughput.describe())
        self.engine = initialize_engine(
            self.bundle.model,
            self.cfg,
            plan.deepspeed,
            self.total_steps,
            temperature_lr=self.temperature.own_group_lr,
        )
        self._wire_step()
        self.checkpointer = Checkpointer(
            plan, rank, engine=self.engine, loss=self.loss, loader=self.loader, temperature=self.temperature
        )
        # each step's micro-batches fetched before the boundary of the step before (a loader that cannot
        # go on stops every rank there, saved): the checkpoint's data position leaves them out
        self.batches = StepBatches(self.loader, self.layout.grad_accum_steps, self._fetching)
        self.checkpointer.loader_state = self.batches.loader_state
        if plan.resume is not None:
            self.load_state_dict(self.checkpointer.restore())
        self._after_applied_step()  # the first step's temperature lr follows tau too (rgcl_g)
        self.log = RunLog(
            self.output_dir,
            self.cfg.to_dict(),
            self.engine.optimizer,
            step=self.step,
            total=self.total_steps,
            main=self.is_main,
        )
        self.preemption: Preemption | None = None  # while train() runs: a stop asked for
        self._evaluated: dict[str, Any] | None = None  # this process's latest evaluation, with its step

    # ---- the run's state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "micro_in_epoch": self.micro_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch, self.micro_in_epoch = state["step"], state["epoch"], state["micro_in_epoch"]

    @property
    def resume_from(self) -> tuple[Path, Path | None] | None:
        """The checkpoint this run resumed from, and its conversion for this number of ranks."""
        resume = self.plan.resume
        return None if resume is None else (resume.folder, resume.universal)

    @property
    def writer(self):
        return self.log.writer

    @property
    def eval_precision(self) -> EvalPrecision:
        """eval.precision for this run's model (engine/evaluate.py)."""
        return EvalPrecision.choose(self.cfg.eval.precision, self.plan.precision.name, "the model")

    # ---- the loop ------------------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        """Train to the end; a stop asked for (a signal, the launcher's end) saves and raises Preempted."""
        self.checkpointer.saved_at = time.monotonic()  # train.save_every_minutes counts from here
        with Preemption(self.cfg.train.preempt_signal) as self.preemption:
            together = False  # every rank ended so: all wait for rank 0's copies (a failure: none)
            try:
                results, together = self._train(), True
                return results
            except (Preempted, DataUnavailable, NonFiniteSteps):
                together = True
                raise
            finally:  # the copies to train.remote_dir up before the process goes
                with self.watchdog.phase("save"):  # a save's allowance: gigabytes may be in flight
                    self.checkpointer.finish_copies(together)

    def _train(self) -> dict[str, float]:
        cfg = self.cfg.train
        progress = self.log.progress_bar(self.total_steps, self.step)
        data_wait = DataWait(
            self.cfg.data.workers, self.layout.per_rank, self.world_size, cores=cores_per_rank()
        )
        shown: dict[str, str] = {}  # the progress bar's last data wait fraction
        while self.step < self.total_steps:
            epoch = self.batches.epoch(data_wait.batches(self._epoch_batches), self._agree_on_data)
            for images, tokens, indices, *keys in epoch:
                self._maybe_unmask()
                metrics = self.train_step(images, tokens, indices, *keys)
                if metrics is None:  # accumulating: no optimizer step yet
                    continue
                data_wait.step_ended()  # after train_step read the loss: the device finished the step
                self.step += 1
                if self.step < self.total_steps:
                    self.batches.fetch_step()  # before the boundary: a failure to fetch is agreed on there
                stop, save_now, no_data = self._end_step(metrics)  # raises NonFiniteSteps after too many
                progress.update(1)
                progress.set_postfix(loss=f"{metrics['loss']:.3f}", **shown, refresh=False)
                window: dict[str, float] = {}
                if self.step % cfg.log_every_steps == 0 or self.step == self.total_steps:
                    window, shown = self._log_window(metrics, data_wait, shown)  # collectives: every rank
                self.log.step(self.step, self.epoch, {**metrics, **throughput_of(window)})
                if stop:  # after the step's logs: the stopped step is in TensorBoard too
                    self._stop_preempted()  # saves, raises Preempted
                if no_data:
                    self._stop_without_data()  # saves, raises DataUnavailable
                if self.cfg.eval.every_steps and self.step % self.cfg.eval.every_steps == 0:
                    self.evaluate()
                if save_now or (cfg.save_every_steps and self.step % cfg.save_every_steps == 0):
                    self.save()
                if self.step >= self.total_steps:
                    break
            else:  # the epoch ran to its end
                self.epoch, self.micro_in_epoch = self.epoch + 1, 0
        progress.close()
        if self.is_main and (line := self.throughput.summary_line()):
            log.info(line)
        self.watchdog.set_phase("finish", self.step)
        if (
            self.checkpointer.saved_step != self.step
        ):  # even over a checkpoint of this step an earlier run left
            self.save()
        return self.evaluate(final=True)

    def train_step(self, images, tokens, indices, keys=None) -> dict[str, float] | None:
        """One micro-batch; returns metrics when it completed an optimizer step, else None. ``keys``: the
        samples' keys (TrainLoader's), which pick their token masks; a loader without them gets the keys
        TrainLoader would give the same indices (data/sample_keys.py)."""
        engine = self.engine
        self.bad_steps.step_started()
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
            **(self.compile_watch.step_ended() if self.compile_watch else {}),
        }

    def _end_step(self, metrics: dict[str, float]) -> tuple[bool, bool, bool]:
        """The step boundary's one collective (reliability/bad_steps.py's ``agree``): this step was bad, a
        stop was asked for (one rank may have the signal), rank 0's clock says save (train.save_every_minutes:
        every rank saves at the same step), a rank's loader cannot go on. Returns (stop, save now, no
        data)."""
        bad = not (metrics["step_applied"] and metrics["loss_finite"])
        stop = self.preemption is not None and self.preemption.requested is not None
        minutes = self.cfg.train.save_every_minutes
        due = self.is_main and minutes > 0 and time.monotonic() - self.checkpointer.saved_at >= minutes * 60
        flags = (bad, stop, due, self.batches.failure is not None)
        bad, stop, due, no_data = agree(*flags, device=self.device, world_size=self.world_size)
        if self.preemption is not None:
            self.preemption.step_ended()
        self.bad_steps.step_ended(bad, self.step, metrics, self.checkpointer.root)
        return stop, due, no_data

    # ---- set-up --------------------------------------------------------------------------------------

    def _build_model(self):
        loss = self.cfg.loss
        bundle = create_model(
            self.cfg.model, temperature_init=loss.temperature_init, logit_bias_init=loss.logit_bias_init
        )
        temperature = TemperatureController.from_config(self.cfg.loss)
        bundle.model.logit_scale.requires_grad_(temperature.learns_global)
        kernels = configure_kernels(bundle.model, self.device)  # swaps modules: before the optimizer exists
        if self.is_main:
            log.info(kernels.summary())
        return bundle, temperature

    def _build_loader(self) -> TrainLoader:
        """The training loader of the plan's shards, sizes (read once, by rank 0) and layout."""
        return TrainLoader.for_run(
            self.cfg,
            micro_batch=self.layout.micro_batch,
            accumulation=self.layout.grad_accum_steps,
            preprocess=self.bundle.preprocess_train,
            tokenize=self.bundle.tokenizer,
            needs_index=preflight.needs_index(self.cfg),
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            sizes=self.plan.preflight.sizes,
        )

    def _wire_step(self) -> None:
        """The step's loss evaluations (train.contrastive_batch: engine/contrastive_step.py; one micro-batch
        a step sees the whole step either way) and the fault layer's hooks around them."""
        layout = self.layout
        if layout.contrastive == "micro" or layout.grad_accum_steps == 1:
            step = MicroBatchStep(self.engine, self.loss, self._model_input)
        else:
            if self.is_main:  # uint8 from open_clip's transform in TrainLoader, else floats
                image_bytes = 1 if getattr(self.loader, "image_transform", None) is not None else 4
                log.info(held_memory(layout, self.bundle.embed_dim, self.bundle.image_shape, image_bytes))
            step = CachedStep(self.engine, self.loss, self._model_input, layout.grad_accum_steps)
        self.contrastive_step = step
        step.note = self.watchdog.set_phase
        self.forward_timer = ForwardTimer(self.device)  # the rank's own work, against the others'
        step.timed = self.forward_timer
        self.stragglers = Stragglers(self.cfg.train.straggler_factor, self.cfg.train.straggler_windows)
        self.watchdog.describe = self._hang_detail
        # BatchNorm's running statistics (RN towers), which a bad step must leave as they were
        stats = running_statistics(self.engine.module)
        self.bad_steps = BadSteps(self.cfg.train.max_skipped_steps, stats, is_main=self.is_main)
        if self.cfg.train.compile:  # the towers compiled in place (engine/compiled.py)
            compile_towers(self.engine.module, self.cfg.train.compile_backend)
        self.compile_watch = CompileWatch() if self.cfg.train.compile else None

    # ---- pieces --------------------------------------------------------------------------------------

    def _hang_detail(self) -> str:
        """For a hang's report: the last collective the loss entered, the loader's workers."""
        last, workers = getattr(self.loss.gatherer, "last", None), getattr(self.loader, "worker_pids", None)
        parts = [f"the last collective its loss entered: {last}"] if last else []
        if workers:
            parts.append(f"its training loader's workers: pids {', '.join(map(str, workers))}")
        return "; ".join(parts)

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
            self.unmasked, self.throughput.unmasked_from = True, self.step + 1
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

    def _epoch_batches(self):
        """This epoch's remaining micro-batches. A resumed epoch goes on in the same order after the
        micro-batches its checkpoint's run had taken: TrainLoader.resume rebuilds its streams there (exactly
        with this rank's saved position, else approximately: docs/data.md); a stand-in loader is read from the
        epoch's start and the taken batches dropped."""
        start, position = self.micro_in_epoch, self.checkpointer.loader_position
        self.checkpointer.loader_position = None
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

    # ---- saves, stops, evaluations, logs -------------------------------------------------------------

    def save(self) -> Path:
        """A checkpoint of this step (checkpointing/checkpointer.py); never of non-finite weights."""
        self.bad_steps.check_before_save(
            self.engine.module, self.step, self.world_size, self.checkpointer.root
        )
        started = time.monotonic()
        with self.watchdog.phase("save"):
            folder = self.checkpointer.save(self.state_dict())
        if self.is_main:
            log.info("saved checkpoint %s", folder)
            budget = self.preemption.save_took(time.monotonic() - started) if self.preemption else None
            if budget:
                log.log(logging.WARNING if "more than" in budget else logging.INFO, "%s", budget)
        if self.preemption is not None:
            self.preemption.mark()  # the next step's time leaves the save out
        return folder

    def _fetching(self):  # the watchdog's phase while the rank waits for its loader
        return self.watchdog.phase("loader", self.step)

    def _agree_on_data(self, failed: bool) -> None:
        """At an epoch's start, its first step fetched: stop every rank where one's loader failed."""
        if agree(failed, device=self.device, world_size=self.world_size)[0]:
            self._stop_without_data()

    def _stop_without_data(self) -> None:
        """Save this step's checkpoint (unless there is one) and raise DataUnavailable, naming what each
        rank whose loader failed could not read."""
        named = self.batches.failures(self.world_size)  # a collective
        if self.checkpointer.saved_step != self.step:
            self.save()
        raise DataUnavailable(
            f"step {self.step}: the training data cannot be read on ({named}); checkpoint "
            f"{self.checkpointer.folder_of(self.step)} complete: resume with --resume latest once it can be"
        )

    def _stop_preempted(self) -> None:
        """Save this step's checkpoint (unless there is one) and raise Preempted."""
        what = self.preemption.requested or "another rank was asked to stop"
        started = time.monotonic()
        if self.checkpointer.saved_step != self.step:
            self.save()
        seconds, folder = time.monotonic() - started, self.checkpointer.folder_of(self.step)
        raise Preempted(
            f"step {self.step}: {what}; checkpoint {folder} complete after {seconds:.1f} s: resume with "
            f"--resume latest (exit code {PREEMPTED_EXIT_CODE})"
        )

    def evaluate(self, final: bool = False) -> dict[str, float]:
        """Every configured evaluation, on every rank with its share of the images (engine.module: the
        weights are whole on every rank under ZeRO stages 0-2); every rank must call it. Rank 0 appends
        {step, epoch, metrics} to eval_results.jsonl and logs TensorBoard's eval/*. Once per step: the
        final call reuses the results of an evaluation at this step."""
        eval_cfg = self.cfg.eval
        if self._evaluated is not None and self._evaluated["step"] == self.step:
            results = {k: v for k, v in self._evaluated.items() if k not in ("step", "epoch")}
        elif eval_cfg.zeroshot_dir or eval_cfg.imagenet_val or eval_cfg.retrieval_shards:
            module, precision = self.engine.module, self.eval_precision
            with (  # the towers eagerly (engine/compiled.py): an evaluation's batch sizes vary
                self.watchdog.phase("evaluation"),
                fp32_weights(module, precision, read_full_parameter) as model,
                eagerly(),
            ):
                results = evaluate_model(
                    model,
                    self.bundle,
                    eval_cfg,
                    device=self.device,
                    dtype=precision.dtype,
                    collectives=Gatherer.from_process_group(),
                    caption_key=self.cfg.data.caption_keys[0],
                )
            self._evaluated = {"step": self.step, "epoch": self.epoch, **results}
            self.log.evaluation(self._evaluated)
            self.log.scalars({f"eval/{k}": v for k, v in results.items()}, self.step, prefix="")
        else:
            results = {}
        if final and results and self.is_main:
            print(format_results(results, self.eval_precision), flush=True)
        throughput = {"throughput": self.throughput.summary()} if final and self.throughput.summary() else {}
        if final and self.is_main and (results or throughput):
            summary = {"step": self.step, **results, **throughput}
            (self.output_dir / "final_metrics.json").write_text(json.dumps(summary, indent=2))
        if self.preemption is not None:
            self.preemption.mark()  # the next step's time leaves the evaluation out
        return results

    def _log_window(self, metrics: dict[str, float], data_wait: DataWait, shown: dict[str, str]):
        """The logging window's TensorBoard scalars: the step's metrics with the samples skipped so far,
        and perf/*; returns perf/* and the progress bar's data wait (``shown`` where none was measured).
        Every rank calls it (collectives)."""
        by_reason = getattr(self.loader, "skipped_by_reason", None)  # (a stand-in loader skips nothing)
        metrics = {**metrics, **self.log.skipped_samples(by_reason, self.step, self.device, self.world_size)}
        perf = self._perf_window(data_wait)
        self.log.scalars(metrics, self.step)
        self.log.scalars(perf, self.step, prefix="")
        if "perf/data_wait_fraction" in perf:
            shown = {"data": f"{perf['perf/data_wait_fraction']:.0%}"}
        return perf, shown

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
        return {
            **data_wait.metrics(window),
            **stragglers,
            **self.throughput.window(window.steps, window.wall, self.step),
        }
