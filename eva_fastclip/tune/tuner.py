"""`eva-fastclip tune`: the fastest layout of the user's recipe that fits their GPUs (docs/launching.md).

The search, every rank taking the same decisions on agreed figures:

1. The memory model (tune/memory_model.py) estimates every layout of the global batch: each micro-batch
   dividing a rank's share, with and without gradient checkpointing, ZeRO 0/1/2, the contrastive batch of
   a micro-batch or of the whole step. Rank 0 traces the model's activations; the figures are broadcast.
2. Probes (tune/probe.py) measure the few that matter: per option, the largest micro-batch estimated to
   fit, an option left out when a cheaper one fits as large a batch (checkpointing, a higher ZeRO stage,
   more ranks' worth of partitioning on one rank). One that does not fit after all is followed by the
   next smaller size. Then the best one's next larger micro-batch is probed (it should not fit: the
   bracket, and the second point of its memory slope) or, at the largest, its next smaller.
3. The real loader runs the chosen layout (tune/probe.py's data_probe): the fewest workers per rank that
   keep the data wait under 5%, or what it would take.

Everything measured is written as the search goes (``tuned.trials.json``, with the probe in flight): a
search that ends during a probe (an unusable device, a hang its watchdog ended, a kill) goes on when
started again with the same config, ranks and limit, that probe counted as failed, in fresh processes.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import shutil
import time
from typing import Any

import torch

from eva_fastclip.config import ConfigError, ExperimentConfig
from eva_fastclip.plan.precision import at_stage, bf16_by_autocast
from eva_fastclip.reliability.process import local_world_size, on_rank0
from eva_fastclip.tune import report
from eva_fastclip.tune.data_search import DATA_WAIT_TARGET, DataSearch
from eva_fastclip.tune.layouts import (
    ZERO_STAGES,
    Trial,
    assign_verdicts,
    candidates,
    fits,
    largest_fitting,
    next_larger,
    preference,
)
from eva_fastclip.tune.memory_model import GIB, estimate, footprint_of, trace_activations
from eva_fastclip.tune.options import TuneOptions, cap_reduce_bucket, check_inputs, check_tunable
from eva_fastclip.tune.probe import DeviceUnusable, quiet_set_up

log = logging.getLogger(__name__)

#: probes of smaller micro-batches after a layout did not fit, per option
STEPS_DOWN = 3


#: traces of this process, by model, dtype and device: plans for several GPU counts trace once
_TRACES: dict[str, dict[str, Any]] = {}


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Tuner:
    """One search: built on every rank of a launch (or alone, for ``--estimate-only``)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        raw: dict[str, Any],
        ds: dict[str, Any],
        opts: TuneOptions,
        watchdog=None,
    ) -> None:
        from eva_fastclip.plan.precision import Hardware, common_hardware, detect_hardware
        from eva_fastclip.plan.run_plan import make_plan

        self.cfg, self.raw, self.opts, self.watchdog = cfg, raw, opts, watchdog
        self.started = time.monotonic()
        self.source = cfg.train.deepspeed_config
        check_tunable(ds, self.source)
        if int(os.environ.get("RANK", "0")) == 0:  # before any probe: a bad path stops the search now
            check_inputs(cfg, data=opts.data and not opts.estimate_only)
        if opts.estimate_only:
            self.rank, self.world_size = 0, opts.gpus
            self.device = torch.device("cpu")  # where the activations are traced
            hardware = Hardware(True, True, f"{opts.gpus} planned GPUs (bf16 native, as on A100 and H100)")
        else:
            from eva_fastclip.reliability.process import join_process_group

            rank = join_process_group(watchdog)
            self.rank, self.world_size, self.device = rank.rank, rank.world_size, rank.device
            hardware = common_hardware(detect_hardware())
        # the recipe's own plan: its global batch, precision and DeepSpeed JSON (the probes' come from theirs)
        plan = make_plan(cfg, ds, world_size=self.world_size, hardware=hardware, inputs=False)
        self.layout, self.precision, self.resolved = plan.layout, plan.precision, plan.deepspeed
        self.global_batch = self.layout.global_batch
        self.target = opts.contrastive_batch or self.global_batch
        self.ds_input = ds
        self.limit = self._memory_limit()
        self.budget = int(self.limit * (1.0 - opts.margin))
        self.notes: list[str] = []
        self.not_measured: list[str] = []
        # the probes' output folder (their Trainers' logs), removed at the end
        self.scratch = opts.output.with_name(opts.output.stem + ".probes")

    # ---- set-up ---------------------------------------------------------------------------------------

    def _memory_limit(self) -> int:
        opts = self.opts
        if opts.estimate_only:
            return int(opts.gpu_memory_gib * GIB)
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            if opts.memory_limit_gib is None:
                return total
            limit = int(opts.memory_limit_gib * GIB)
            if limit > total:
                raise ConfigError(
                    f"--memory-limit-gib {opts.memory_limit_gib} is more than this GPU's "
                    f"{total / GIB:.1f} GiB: leave it out to use the whole GPU"
                )
            torch.cuda.set_per_process_memory_fraction(limit / total, self.device)  # a real OOM above it
            return limit
        if opts.memory_limit_gib is not None:
            return int(opts.memory_limit_gib * GIB)
        ranks_here = local_world_size()
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_here

    def _trace(self) -> dict[str, Any]:
        """The model's facts and activation line, traced by rank 0 on fake tensors in the run's precision."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision.name, torch.float32)
        if dtype == torch.float16:
            dtype = torch.bfloat16  # the same bytes; the trace runs CPU kernels, not all of them fp16
        key = json.dumps([dataclasses.asdict(self.cfg.model), str(dtype)], sort_keys=True)

        def trace() -> dict[str, Any]:
            if key not in _TRACES:
                with quiet_set_up():
                    activations, facts = trace_activations(self.cfg, dtype)
                _TRACES[key] = {"activations": activations, **facts}
            return _TRACES[key]

        return on_rank0(trace)

    def _table_rows(self) -> int:
        from eva_fastclip.plan import preflight

        if not self.cfg.loss.is_compositional:
            return 0
        if self.cfg.data.index_size is not None:
            return self.cfg.data.index_size
        try:
            rows = on_rank0(lambda: preflight.data_sizes(self.cfg).index_size)
        except ValueError as err:
            raise ConfigError(f"the per-sample table's size: {err}") from None
        return rows or 0

    # ---- the search -----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        traced = self.prepare()
        if self.opts.estimate_only:
            self.not_measured.append("everything: an estimate-only plan (peak_gib and samples_per_s null)")
        else:
            self._search()
        chosen = assign_verdicts(self.trials, self.budget, self.target)
        data = self._tune_data(chosen) if chosen is not None and not self.opts.estimate_only else {}
        return self._finish(chosen, data, traced)

    def prepare(self) -> dict[str, Any]:
        """Trace the model, build the footprint and estimate every layout (``self.trials``); returns the
        traced facts."""
        traced = self._trace()
        trainable, self.context_length = traced["trainable"], traced["context_length"]
        self.ds, bucket_note = cap_reduce_bucket(self.ds_input, trainable)
        if bucket_note and self.world_size > 1:
            self.notes.append(bucket_note)
        resolved, _ = cap_reduce_bucket(self.resolved, trainable)
        self.footprint = footprint_of(
            self.cfg,
            resolved,
            parameters=traced["parameters"],
            trainable=trainable,
            embed_dim=traced["embed_dim"],
            image_shape=tuple(traced["image_shape"]),
            table_rows=self._table_rows(),
            activations=traced["activations"],
            device="cuda" if self.opts.estimate_only else self.device.type,
            largest_tensor=traced["largest_tensor"],
            autocast_at_zero0=self.precision.name == "bf16"
            and bf16_by_autocast(at_stage(self.ds_input, 0), self.source),
        )
        stages = (0,) if self.world_size == 1 else ZERO_STAGES  # one rank: ZeRO partitions nothing
        if self.world_size == 1:
            self.notes.append("one rank: ZeRO-1/2 partition nothing, so only stage 0 is considered")
        self.trials = []
        for candidate in candidates(self.global_batch, self.world_size, stages):
            breakdown = estimate(candidate, self.footprint)
            self.trials.append(Trial(candidate, breakdown["peak"], breakdown))
        self._previous = on_rank0(self._read_previous)  # rank 0 writes the file: its reading counts
        return traced

    def _search(self) -> None:
        for trial in self._initial_probes():
            self._probe_down(trial)
        measured = [t for t in self.trials if t.samples_per_s is not None and fits(t, self.budget)]
        if not measured:
            return
        best = min(measured, key=lambda t: preference(t, self.target))
        larger = next_larger(self.trials, best)
        if larger is None:  # the largest micro-batch fits: its next smaller is the slope's second point
            smaller = [
                t for t in self.trials if t.candidate.option == best.candidate.option and t is not best
            ]
            if smaller:
                self._probe(max(smaller, key=lambda t: t.candidate.micro_batch))
            return
        while larger is not None:  # the bracket: the next size should not fit; if it does, go on
            self._probe(larger)
            if not fits(larger, self.budget):
                break
            larger = next_larger(self.trials, larger)

    def _initial_probes(self) -> list[Trial]:
        """Per option the largest micro-batch estimated to fit, less the options a cheaper one beats:
        checkpointing or a higher ZeRO stage that fits no larger a micro-batch, and micro contrastive
        batches below the target where a global one fits."""
        best = largest_fitting(self.trials, self.budget)
        picks: list[Trial] = []
        for ckpt in (False, True):
            for stage in sorted({option[1] for option in best}):
                micro, whole = best.get((ckpt, stage, "micro")), best.get((ckpt, stage, "global"))
                if micro is not None and micro.candidate.contrastive_batch >= self.target:
                    pick = micro
                else:
                    pick = whole or micro
                if pick is None:
                    continue
                cheaper = [
                    p
                    for p in picks
                    if p.candidate.micro_batch >= pick.candidate.micro_batch
                    and p.candidate.contrastive_batch >= pick.candidate.contrastive_batch
                ]
                if not cheaper:
                    picks.append(pick)
        return picks

    def _probe_down(self, trial: Trial) -> None:
        """Probe ``trial``; if it does not fit, the next smaller micro-batches of its option."""
        for _ in range(STEPS_DOWN):
            self._probe(trial)
            if fits(trial, self.budget):
                return
            smaller = [
                t
                for t in self.trials
                if t.candidate.option == trial.candidate.option
                and t.candidate.micro_batch < trial.candidate.micro_batch
            ]
            if not smaller:
                return
            trial = max(smaller, key=lambda t: t.candidate.micro_batch)

    def _probe(self, trial: Trial) -> None:
        from eva_fastclip.tune.probe import model_probe

        if trial.peak is not None or trial.oom:
            return
        name = trial.candidate.name()
        previous = self._previous.get(name)
        if previous is not None:  # measured by an earlier run of this search, or the probe it died in
            trial.peak, trial.oom = previous["peak"], previous["oom"]
            trial.samples_per_s, trial.why = previous["samples_per_s"], previous["why"]
            return
        if self.rank == 0:
            log.info("probe %s (estimate %.2f GiB)", name, trial.est_peak / GIB)
        if self.watchdog is not None:
            self.watchdog.set_phase("start-up", 0)
        self._save_progress(in_flight=name)  # a search that dies here skips this probe when run again
        try:
            result = model_probe(
                self.cfg,
                self.ds,
                trial.candidate,
                table_rows=self.footprint.table_rows,
                image_shape=self.footprint.image_shape,
                context_length=self.context_length,
                output_dir=str(self.scratch),
                limit=self.limit if self.device.type == "cpu" and self.opts.memory_limit_gib else None,
                watchdog=self.watchdog,
                steps=self.opts.probe_steps,
            )
        except DeviceUnusable as err:
            trial.oom, trial.why = True, f"the device was unusable after it: {err}"
            self._save_progress()
            raise
        trial.oom, trial.peak = result.oom, result.peak
        if result.step_s:
            trial.samples_per_s = self.global_batch / result.step_s
        if result.oom:
            trial.why = "out of memory" + (f": {result.detail}" if result.detail else "")
        if self.rank == 0:
            peak = "out of memory" if result.oom else f"peak {result.peak / GIB:.3f} GiB"
            speed = f", {trial.samples_per_s:.1f} samples/s" if trial.samples_per_s else ""
            log.info("  %s%s", peak, speed)
        self._save_progress()

    # ---- results --------------------------------------------------------------------------------------

    def _tune_data(self, chosen: Trial) -> dict[str, Any]:
        """The loader's workers and decode for the chosen layout (tune/data_search.py)."""
        if not self.opts.data:
            self.not_measured.append("the data rate (--no-data): data.workers and data.image_decode kept")
            return {}
        search = DataSearch(self.cfg, self.ds, self.world_size, self.rank, str(self.scratch), self.watchdog)
        found = search.run(chosen)
        self.notes += search.notes
        self.not_measured += search.not_measured
        return found

    def _fingerprint(self) -> str:
        return _fingerprint(
            self.cfg.to_dict(), self.ds_input, self.world_size, self.limit, self.opts.margin, self.device.type
        )

    def _read_previous(self) -> dict[str, dict[str, Any]]:
        """Probes of an earlier run of the same search (same config, ranks, limit, device), by name."""
        if self.opts.estimate_only:
            return {}
        return report.read_previous(report.trials_path(self.opts.output), self._fingerprint())

    def _trials_payload(self, in_flight: str | None = None) -> dict[str, Any]:
        return report.trials_payload(
            self.trials,
            fingerprint=self._fingerprint(),
            global_batch=self.global_batch,
            world_size=self.world_size,
            limit=self.limit,
            budget=self.budget,
            in_flight=in_flight,
        )

    def _save_progress(self, in_flight: str | None = None) -> None:
        if self.rank == 0:
            report.write_json(report.trials_path(self.opts.output), self._trials_payload(in_flight))

    def _finish(self, chosen: Trial | None, data: dict[str, Any], traced: dict[str, Any]) -> dict[str, Any]:
        self.not_measured += [
            "evaluation memory (eval.batch_size is not probed: evaluation runs without gradients)",
        ]
        if not self.opts.estimate_only:
            local = local_world_size()
            if local == self.world_size and self.world_size > 1:
                self.not_measured.append("inter-node bandwidth: every rank is on this node")
            if self.footprint.device == "cuda" and self.footprint.table_rows:
                self.not_measured.append("the per-sample table (host memory, estimated)")
        summary = {
            "chosen": None if chosen is None else report.trial_row(chosen),
            "config": None,
            "deepspeed_config": None,
            "precision": self.precision.name,
            "estimates_only": self.opts.estimate_only,
            "not_measured": self.not_measured,
            "notes": self.notes,
            "data": data,
        }
        if self.rank != 0:
            return summary
        shutil.rmtree(self.scratch, ignore_errors=True)
        payload = self._trials_payload()
        payload.update(
            precision=self.precision.name,
            model={
                k: traced[k]
                for k in ("parameters", "trainable", "largest_tensor", "embed_dim", "image_shape")
            },
            activations_bytes_per_sample={
                "no_checkpointing": traced["activations"][False][0],
                "checkpointing": traced["activations"][True][0],
            },
            not_measured=self.not_measured,
            notes=self.notes,
            data=data,
            estimates_only=self.opts.estimate_only,
        )
        report.write_json(report.trials_path(self.opts.output), payload)
        print(report.format_table(self.trials, self.limit / GIB, self.budget / GIB))
        if chosen is None:
            smallest = min(self.trials, key=lambda t: t.known_peak)
            raise ConfigError(
                f"no layout of the global batch {self.global_batch} fits {self.budget / GIB:.2f} GiB a rank "
                f"(the limit less the margin); the smallest, {smallest.candidate.name()}, needs "
                f"{smallest.known_peak / GIB:.2f} GiB: more ranks or more memory "
                f"(trials in {report.trials_path(self.opts.output)})"
            )
        ds_out = report.ds_path(self.opts.output)
        ds_json = at_stage(self.ds, chosen.candidate.zero_stage)  # as probed (bf16 by autocast at stage 0)
        report.write_json(ds_out, ds_json)
        record = self._record(chosen, data)
        config = report.tuned_config(self.raw, chosen, str(ds_out), data, record)
        report.write_json(self.opts.output, config)
        summary.update(config=str(self.opts.output), deepspeed_config=str(ds_out))
        print(self._describe(chosen, data))
        return summary

    def _record(self, chosen: Trial, data: dict[str, Any]) -> dict[str, Any]:
        c, measured = chosen.candidate, chosen.peak is not None
        peak = f"{chosen.known_peak / GIB:.3f} GiB {'measured' if measured else 'estimated'}"
        speed = (
            f"{chosen.samples_per_s:.1f} samples/s measured" if chosen.samples_per_s else "speed not measured"
        )
        why = {
            "train.max_micro_batch": (
                f"{c.micro_batch} ({c.grad_accum_steps} micro-batch(es) a step on {c.world_size} rank(s)): "
                f"{peak}, budget {self.budget / GIB:.3f} GiB; {speed}"
            ),
            "train.contrastive_batch": (
                f"{c.contrastive}: each loss evaluation sees {c.contrastive_batch} pairs "
                f"(asked for: {self.target})"
            ),
            "model.grad_checkpointing": f"{c.grad_checkpointing}",
            "zero_optimization.stage": f"{c.zero_stage} (in {report.ds_path(self.opts.output).name})",
        }
        if data.get("chosen"):
            best = data["chosen"]
            why["data.workers"] = (
                f"{best['workers']}: data wait {best['data_wait']:.1%} at {best['samples_per_s']:.1f} "
                "samples/s end to end, the fewest workers per rank under 5%"
                if best["data_wait"] <= DATA_WAIT_TARGET
                else f"{best['workers']}: data wait {best['data_wait']:.1%} (above 5%: see notes)"
            )
            why["data.image_decode"] = best["image_decode"]
        return {
            "by": "eva-fastclip tune",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "world_size": self.world_size,
            "device": self._device_name(),
            "precision": self.precision.name,
            "memory_limit_gib": round(self.limit / GIB, 3),
            "margin": self.opts.margin,
            "estimates_only": self.opts.estimate_only,
            "why": why,
            "notes": self.notes,
            "not_measured": self.not_measured,
            "trials": str(report.trials_path(self.opts.output)),
            "seconds": round(time.monotonic() - self.started, 1),
        }

    def _device_name(self) -> str:
        if self.opts.estimate_only:
            return f"{self.opts.gpus} GPUs of {self.opts.gpu_memory_gib:g} GiB (planned)"
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        from eva_fastclip.plan.precision import cpu_model

        return f"CPU ({cpu_model()})"

    def _describe(self, chosen: Trial, data: dict[str, Any]) -> str:
        c = chosen.candidate
        lines = [
            f"chosen: micro-batch {c.micro_batch} x {c.grad_accum_steps} accumulated on {c.world_size} "
            f"rank(s) (global batch {c.global_batch}), contrastive batch {c.contrastive_batch} "
            f"({c.contrastive}), gradient checkpointing {'on' if c.grad_checkpointing else 'off'}, "
            f"ZeRO-{c.zero_stage}"
            + (f", {data['workers']} loader worker(s) per rank" if data.get("workers") else ""),
        ]
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"not measured: {what}" for what in self.not_measured]
        lines.append(f"tune took {time.monotonic() - self.started:.0f} s")
        lines.append(
            f"wrote {self.opts.output} (train --config), {report.ds_path(self.opts.output)}, "
            f"{report.trials_path(self.opts.output)}"
        )
        return "\n".join(lines)
