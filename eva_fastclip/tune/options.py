"""What tune is asked (its options) and what it may change in the user's DeepSpeed JSON; the inputs it
checks before any probe."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from eva_fastclip.config import ConfigError, ExperimentConfig


@dataclasses.dataclass
class TuneOptions:
    output: Path
    memory_limit_gib: float | None = None
    margin: float = 0.10
    contrastive_batch: int | None = None
    estimate_only: bool = False
    gpus: int | None = None
    gpu_memory_gib: float | None = None
    data: bool = True
    probe_steps: int = 3  # timed optimizer steps a probe trains after its untimed first (probe.PROBE_STEPS)

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin < 1.0:
            raise ConfigError(f"--memory-margin must be in [0, 1), got {self.margin}")
        if self.memory_limit_gib is not None and self.memory_limit_gib <= 0:
            raise ConfigError(f"--memory-limit-gib must be > 0, got {self.memory_limit_gib}")
        if self.contrastive_batch is not None and self.contrastive_batch < 1:
            raise ConfigError(f"--contrastive-batch must be >= 1, got {self.contrastive_batch}")
        if self.estimate_only and (self.gpus is None or self.gpu_memory_gib is None):
            raise ConfigError("--estimate-only plans for GPUs you name: give --gpus N and --gpu-memory-gib M")
        if not self.estimate_only and (self.gpus is not None or self.gpu_memory_gib is not None):
            raise ConfigError(
                "--gpus and --gpu-memory-gib plan a run elsewhere: add --estimate-only (a search that "
                "measures runs on the ranks it is launched with, under --memory-limit-gib)"
            )
        if self.probe_steps < 1:
            raise ConfigError(f"--probe-steps must be >= 1, got {self.probe_steps}")
        if self.output.suffix != ".json":
            raise ConfigError(f"--output {self.output} must name a .json file (e.g. tuned.json)")


def check_tunable(ds: dict[str, Any], source: str) -> None:
    """tune sets the micro-batch and the accumulation: the DeepSpeed JSON must leave them to the
    experiment ("auto"), as the shipped ones do."""
    fixed = [
        key
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        if ds.get(key, "auto") != "auto"
    ]
    if fixed:
        raise ConfigError(
            f"{source} fixes {', '.join(f'{k}={ds[k]}' for k in fixed)}: tune chooses the micro-batch and "
            'the accumulation, so write "auto" for them (train_batch_size may stay: it is the global batch)'
        )


def check_inputs(cfg: ExperimentConfig, *, data: bool) -> None:
    """What the probes read: the model's files, the image decode, and (for the loader's rate) the shards."""
    from eva_fastclip.plan import preflight

    problems = preflight.check_model(cfg) + preflight.check_image_decode(cfg)
    if data:
        problems += preflight.check_train_shards(cfg)[1]
    preflight.raise_for_errors(problems)


def cap_reduce_bucket(ds: dict[str, Any], trainable: int) -> tuple[dict[str, Any], str | None]:
    """DeepSpeed allocates its whole reduce bucket (``reduce_bucket_size`` elements, 5e8 by default) at
    every backward under ZeRO-1/2, however small the model: one bucket of the model's own size holds
    every gradient, so the same reductions happen in less memory. Returns the JSON and what changed."""
    zero = ds.get("zero_optimization", {})
    current = int(zero.get("reduce_bucket_size", 500_000_000))
    size = int(math.ceil(trainable / 1e6) * 1e6)  # whole millions: a readable number in the JSON
    if size >= current:
        return ds, None
    ds = json.loads(json.dumps(ds))
    ds.setdefault("zero_optimization", {})["reduce_bucket_size"] = size
    return ds, (
        f"zero_optimization.reduce_bucket_size {current:.3g} -> {size:.3g} elements: the model's "
        f"{trainable:,} trained parameters in one bucket; DeepSpeed allocates the whole bucket at every "
        "backward under ZeRO-1/2"
    )
