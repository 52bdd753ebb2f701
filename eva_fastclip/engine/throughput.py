"""The training log's throughput: samples/s per rank, model TFLOP/s per rank and MFU.

Over a logging window of n optimizer steps that took t seconds (reliability/data_wait.py's window: the
steps' own time on the slowest rank, evaluations, saves and loader start-up left out), with G the global
batch, K ranks and F the model FLOPs of one training sample (models/flops.py: 3 x the forward's matrix
products over the tokens the masking keeps, no recomputation):

    samples/s per rank   S = n · G / (t · K)           (one rank per GPU: per GPU)
    TFLOP/s per rank     S · F / 10¹²
    MFU                  TFLOP/s per rank / the device's dense peak in the run's precision

F changes when EVA-CLIP's unmasked final phase begins (``model.unmasked_final_steps``): a window's FLOPs
are its steps' own. The peak is ``train.peak_tflops`` where set, else NVIDIA's data-sheet figure
(:data:`PEAK_TFLOPS`) for the device ``torch.cuda.get_device_name`` names; elsewhere there is no MFU.
The run's end logs the means over this process's windows (time-weighted), which final_metrics.json keeps
under ``throughput``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from eva_fastclip.config import ExperimentConfig
from eva_fastclip.models.flops import ModelFlops, model_flops
from eva_fastclip.plan.precision import cpu_model

#: dense (no 2:4 sparsity) peak TFLOP/s of one GPU by precision, from NVIDIA's data sheets (the sheets
#: quote the sparse figures, twice these); "tf32": fp32 matmuls on the tensor cores
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "GH200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
}
#: what in ``torch.cuda.get_device_name()`` (lower case) names each row, the most specific first: e.g.
#: "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H200"
_DEVICE_NAMES = (
    ("gh200", "GH200"),
    ("h200 nvl", "H200 NVL"),
    ("h200", "H200 SXM"),
    ("h100 nvl", "H100 NVL"),
    ("h100 pcie", "H100 PCIe"),
    ("h100", "H100 SXM"),
    ("a100", "A100"),
)
#: the window's figures the step log's line of a window's last step carries too
THROUGHPUT_KEYS = ("perf/samples_per_s_per_rank", "perf/tflops_per_rank", "perf/mfu")


def device_row(name: str) -> str | None:
    """The row of :data:`PEAK_TFLOPS` for a CUDA device's name, or None."""
    lower = name.lower()
    return next((row for part, row in _DEVICE_NAMES if part in lower), None)


def matmul_precision(precision: str) -> str:
    """The peak's column for a run's precision (bf16, fp16, fp32): fp32 matmuls run as TF32 where torch
    allows it (``torch.backends.cuda.matmul.allow_tf32``)."""
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return precision


@dataclasses.dataclass(frozen=True)
class Peak:
    """One rank's peak TFLOP/s for MFU (None: unknown) and where it came from, for the start-up log."""

    tflops: float | None
    source: str

    @classmethod
    def find(cls, configured: float | None, device: torch.device, precision: str) -> Peak:
        """``train.peak_tflops`` if set, else the table's figure for ``device`` in ``precision``."""
        if configured is not None:
            return cls(float(configured), "train.peak_tflops")
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
        else:
            name = f"{device.type} ({cpu_model()})"
        row, column = device_row(name), matmul_precision(precision)
        if row is None or column not in PEAK_TFLOPS[row]:
            return cls(None, f"no peak known for {name}")
        return cls(PEAK_TFLOPS[row][column], f"{name}: {row}, {column} dense")


class Throughput:
    """One rank's windows: their figures for TensorBoard and the step log, and the run's means.

    ``flops``: per training sample as the run starts (None: not counted, samples/s only); ``unmasked``:
    without patch dropout, for EVA-CLIP's unmasked final phase (None: the run has none);
    ``samples_per_step``: the rank's share of the global batch."""

    def __init__(
        self, flops: ModelFlops | None, unmasked: ModelFlops | None, samples_per_step: int, peak: Peak
    ) -> None:
        self.flops, self.unmasked, self.peak = flops, unmasked, peak
        self.samples_per_step = samples_per_step
        self.unmasked_from: int | None = None  # the first step without patch dropout (the trainer sets it)
        self.not_counted = ""  # why there is no FLOP count
        self._steps, self._seconds, self._flops = 0, 0.0, 0.0  # over the run's windows

    @classmethod
    def for_run(
        cls, cfg: ExperimentConfig, per_rank: int, device: torch.device, precision: str, count: bool = True
    ) -> Throughput:
        """The run's FLOPs per sample (counted once, on a meta copy of the model) and its peak. A model the
        count cannot trace still trains: its log has samples/s, no TFLOP/s or MFU. ``count``: False on the
        ranks that log nothing (the count takes a second or two of a rank's start-up)."""
        peak = Peak.find(cfg.train.peak_tflops, device, precision)
        if not count:
            made = cls(None, None, per_rank, peak)
            made.not_counted = "counted by rank 0, which logs"
            return made
        try:
            flops = model_flops(cfg.model)
            unmasked = None
            if cfg.model.unmasked_final_steps and cfg.model.patch_dropout:
                unmasked = model_flops(cfg.model, patch_dropout=0.0)
        except Exception as err:  # a figure of the log never stops a run
            made = cls(None, None, per_rank, peak)
            made.not_counted = f"{type(err).__name__}: {err}"
            return made
        return cls(flops, unmasked, per_rank, peak)

    def describe(self) -> str:
        """The start-up log's line: the FLOPs per sample and the peak MFU divides by."""
        if self.flops is None:
            return f"model FLOPs not counted ({self.not_counted}): the log has samples/s, no TFLOP/s or MFU"
        line = f"model FLOPs: {self.flops.describe()}"
        if self.unmasked is not None:
            line += f"; {self.unmasked.training / 1e9:.4g} GFLOP in the unmasked final phase"
        if self.peak.tflops is None:
            return f"{line}; {self.peak.source}: set train.peak_tflops for MFU"
        return f"{line}; MFU against a peak of {self.peak.tflops:g} TFLOP/s per rank ({self.peak.source})"

    def step_flops(self, first: int, last: int) -> float:
        """Training FLOPs of one rank over the optimizer steps ``first`` to ``last`` (0 uncounted)."""
        if self.flops is None:
            return 0.0
        steps = last - first + 1
        late = 0 if self.unmasked_from is None else max(0, last - max(first, self.unmasked_from) + 1)
        one_sample = (steps - late) * self.flops.training + late * (self.unmasked or self.flops).training
        return one_sample * self.samples_per_step

    def window(self, steps: int, seconds: float, last_step: int) -> dict[str, float]:
        """A window's ``perf/*`` throughput figures (none without a step or time); added to the run's."""
        if steps <= 0 or seconds <= 0:
            return {}
        flops = self.step_flops(last_step - steps + 1, last_step)
        self._steps += steps
        self._seconds += seconds
        self._flops += flops
        return self._figures(steps, seconds, flops)

    def _figures(self, steps: int, seconds: float, flops: float) -> dict[str, float]:
        figures = {"perf/samples_per_s_per_rank": steps * self.samples_per_step / seconds}
        if self.flops is None:
            return figures
        figures["perf/tflops_per_rank"] = tflops = flops / seconds / 1e12
        if self.peak.tflops:
            figures["perf/mfu"] = tflops / self.peak.tflops
        return figures

    def summary(self) -> dict[str, Any]:
        """The means over the run's windows (final_metrics.json's ``throughput``); {} before any."""
        if not self._steps:
            return {}
        figures = self._figures(self._steps, self._seconds, self._flops)
        summary: dict[str, Any] = {key.removeprefix("perf/"): value for key, value in figures.items()}
        summary.update(steps=self._steps, seconds=self._seconds, peak_tflops=self.peak.tflops)
        if self.flops is not None:
            summary["gflop_per_sample"] = self.flops.training / 1e9
        return summary

    def summary_line(self) -> str | None:
        """The run's end's log line, or None before any window."""
        s = self.summary()
        if not s:
            return None
        line = (
            f"throughput over {s['steps']} steps ({s['seconds']:.1f} s of step time): "
            f"{s['samples_per_s_per_rank']:.4g} samples/s per rank"
        )
        if "tflops_per_rank" in s:
            line += f", {s['tflops_per_rank']:.4g} TFLOP/s per rank"
        return line + (f", MFU {s['mfu']:.1%}" if "mfu" in s else "")


def throughput_of(window: dict[str, float]) -> dict[str, float]:
    """The window's throughput figures, for the step log's line of its last step."""
    return {key: window[key] for key in THROUGHPUT_KEYS if key in window}
