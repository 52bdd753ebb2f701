"""The DeepSpeed JSON: read it, fill its "auto" values from the experiment config, check the rest.

The DeepSpeed JSON owns the engine (ZeRO stage, precision, clipping, optimizer type and betas); the
experiment config owns what depends on the experiment (batch sizes, lr, weight decay, schedule). Keys the
experiment owns may be "auto" in the JSON; a concrete value that disagrees stops the run before it starts.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from eva_fastclip.config import ConfigError, ExperimentConfig
from eva_fastclip.plan.layout import BatchLayout
from eva_fastclip.plan.precision import (
    Hardware,
    PrecisionChoice,
    apply_precision,
    choose_precision,
    detect_hardware,
    precision_in_deepspeed_json,
)

#: the optimizer types of the DeepSpeed JSON that eva_fastclip builds (optim/optimizer.py)
SUPPORTED_OPTIMIZERS = ("Lamb", "AdamW")


def load_deepspeed_config(path: str | Path) -> dict[str, Any]:
    try:
        ds = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"train.deepspeed_config={str(path)!r} does not exist (see ds_configs/)") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {err}") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"DeepSpeed config {path} must hold a JSON object")
    return ds


def resolve_deepspeed_config(
    ds: dict[str, Any],
    cfg: ExperimentConfig,
    layout: BatchLayout,
    *,
    source: str,
    hardware: Hardware | None = None,
    precision: PrecisionChoice | None = None,
) -> dict[str, Any]:
    """Fill "auto" values from the experiment config and check that everything else agrees with it.

    The precision is ``precision`` where the caller has chosen it already (a resumed run keeps its
    checkpoint's), else chosen for ``hardware`` (this machine's device when None): plan/precision.py.
    """
    ds = copy.deepcopy(ds)
    if ds.get("autotuning", {}).get("enabled", False):
        raise ConfigError(
            f"{source} enables DeepSpeed's autotuner, which changes the global batch (the recipe) and stops "
            "the engine after its profile steps: remove the 'autotuning' section and run `eva-fastclip "
            "tune` instead, which keeps train.global_batch (docs/launching.md, DeepSpeed's autotuner)"
        )
    owned = [
        ("train_micro_batch_size_per_gpu", layout.micro_batch, layout.owners()["micro_batch"]),
        ("gradient_accumulation_steps", layout.grad_accum_steps, layout.owners()["grad_accum_steps"]),
        ("train_batch_size", layout.global_batch, layout.owners()["global_batch"]),
    ]
    for key, value, owner in owned:
        _fill_or_check(ds, key, value, owner, source)

    if "scheduler" in ds:
        raise ConfigError(
            f"{source} has a 'scheduler' section: the schedule comes from the experiment config "
            "(optim.warmup_steps, optim.min_lr_ratio); remove the section"
        )
    optimizer = ds.get("optimizer")
    if not isinstance(optimizer, dict) or optimizer.get("type") not in SUPPORTED_OPTIMIZERS:
        raise ConfigError(
            f"{source} needs an 'optimizer' section with type one of {SUPPORTED_OPTIMIZERS}, "
            f'e.g. {{"type": "Lamb", "params": {{"lr": "auto", "weight_decay": "auto"}}}}'
        )
    params = optimizer.setdefault("params", {})
    _fill_or_check(params, "lr", cfg.optim.lr, "optim.lr", source, prefix="optimizer.params.")
    _fill_or_check(
        params,
        "weight_decay",
        cfg.optim.weight_decay,
        "optim.weight_decay",
        source,
        prefix="optimizer.params.",
    )

    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise ConfigError(
            f"{source} sets zero_optimization.stage={stage}; eva_fastclip supports stages 0-2 "
            "(stage 3 partitions the weights that evaluation and the losses read whole)"
        )
    apply_precision(
        ds, precision or resolve_precision(cfg, ds, source=source, hardware=hardware), source=source
    )
    ds.setdefault("zero_allow_untested_optimizer", True)  # timm's LAMB on CPU is "untested" to DeepSpeed
    return ds


def resolve_precision(
    cfg: ExperimentConfig, ds: dict[str, Any], *, source: str, hardware: Hardware | None = None
) -> PrecisionChoice:
    """The precision a run trains in: ``train.precision`` and the DeepSpeed JSON, for ``hardware``."""
    return choose_precision(
        cfg.train.precision,
        precision_in_deepspeed_json(ds, source),
        hardware or detect_hardware(),
        source=source,
    )


def _fill_or_check(
    section: dict[str, Any], key: str, value: Any, owner: str, source: str, prefix: str = ""
) -> None:
    current = section.get(key, "auto")
    if current == "auto":
        section[key] = value
    elif current != value:
        raise ConfigError(
            f"{source} sets {prefix}{key}={current} but the experiment config gives {value} "
            f'({owner}): change one of them to match, or write "auto" in the DeepSpeed JSON'
        )


def autocast_dtype(ds: dict[str, Any]) -> torch.dtype:
    """The dtype DeepSpeed keeps the module in (inputs are cast to it): fp32 under autocast."""
    if ds.get("bf16", {}).get("enabled", False):
        return torch.bfloat16
    if ds.get("fp16", {}).get("enabled", False):
        return torch.float16
    return torch.float32
