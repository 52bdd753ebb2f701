"""DeepSpeed set-up: read and reconcile the DeepSpeed JSON, build the optimizer and schedule, initialize.

The DeepSpeed JSON owns the engine (ZeRO stage, precision, clipping, optimizer type and betas); the
experiment config owns what depends on the experiment (batch sizes, lr, weight decay, schedule). Keys the
experiment owns may be "auto" in the JSON; a concrete value that disagrees stops the run before it starts.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eva_fastclip.config import BatchLayout, ConfigError, ExperimentConfig, OptimConfig
from eva_fastclip.engine.precision import (
    Hardware,
    PrecisionChoice,
    apply_precision,
    choose_precision,
    detect_hardware,
    precision_in_deepspeed_json,
)
from eva_fastclip.models import parameter_groups
from eva_fastclip.models.param_groups import TEMPERATURE_GROUP

SUPPORTED_OPTIMIZERS = ("Lamb", "AdamW")
#: FusedLamb's own settings that optimizer.params may hold for "Lamb"; both devices get them.
LAMB_PARAMS = ("bias_correction", "eps_inside_sqrt", "max_coeff", "min_coeff")


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
    checkpoint's), else chosen for ``hardware`` (this machine's device when None): engine/precision.py.
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

    apply_precision(ds, precision or resolve_precision(cfg, ds, source=source, hardware=hardware))
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise ConfigError(
            f"{source} sets zero_optimization.stage={stage}; eva_fastclip supports stages 0-2 "
            "(stage 3 partitions the weights that evaluation and the losses read whole)"
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
    """The dtype DeepSpeed keeps the module in (inputs are cast to it)."""
    if ds.get("bf16", {}).get("enabled", False):
        return torch.bfloat16
    if ds.get("fp16", {}).get("enabled", False):
        return torch.float16
    return torch.float32


def build_optimizer(
    ds: dict[str, Any],
    model: nn.Module,
    optim: OptimConfig,
    *,
    cuda: bool,
    temperature_lr: float | None = None,
) -> torch.optim.Optimizer:
    """LAMB / AdamW over our parameter groups, the same updates on CUDA and CPU.

    ``ds`` is the resolved DeepSpeed JSON: its lr is the optimizer's default, while each group carries its
    own peak lr and weight decay from ``optim`` (per tower, per layer), which the schedule multiplies.
    LAMB is our ``Lamb`` (FusedLamb's update in PyTorch ops, trust ratio per model tensor once
    :func:`initialize_engine` has attached the ZeRO partitions); with ``optim.lamb_trust_ratio =
    "per_zero_partition"`` it is DeepSpeed's FusedLamb on CUDA, and our ``Lamb`` left per flat partition
    elsewhere. A group with ``trust_ratio`` False (the temperature, unless ``optim.temperature_trust_ratio``)
    gets the trust-ratio bounds max_coeff = min_coeff = 1, which both read per group: an Adam step.
    AdamW is DeepSpeed's FusedAdam on CUDA and PyTorch's fused AdamW elsewhere.
    """
    kind = ds["optimizer"]["type"]
    params = dict(ds["optimizer"]["params"])
    lr, weight_decay = params.pop("lr"), params.pop("weight_decay")
    if (lr, weight_decay) != (optim.lr, optim.weight_decay):
        raise ConfigError(
            f"DeepSpeed optimizer.params lr={lr}, weight_decay={weight_decay} differ from optim.lr="
            f"{optim.lr}, optim.weight_decay={optim.weight_decay}: pass the config through "
            "resolve_deepspeed_config first"
        )
    groups = parameter_groups(model, optim, temperature_lr=temperature_lr)
    betas = tuple(params.pop("betas", (0.9, 0.98)))
    eps = params.pop("eps", 1e-6)
    lamb_args = {key: params.pop(key) for key in LAMB_PARAMS if kind == "Lamb" and key in params}
    if params:
        allowed = ["betas", "eps", *(LAMB_PARAMS if kind == "Lamb" else ())]
        raise ConfigError(
            f"optimizer.params has keys eva_fastclip does not pass on to {kind}: {sorted(params)} "
            f"(it takes lr, weight_decay, {', '.join(allowed)}; the gradient is clipped by gradient_clipping)"
        )
    for group in groups:
        if not group.pop("trust_ratio", True) and kind == "Lamb":
            group.update(max_coeff=1.0, min_coeff=1.0)
    if kind == "Lamb":
        if cuda and optim.lamb_trust_ratio == "per_zero_partition":
            from deepspeed.ops.lamb import FusedLamb as Lamb
        else:
            from eva_fastclip.engine.lamb import Lamb
        optimizer = Lamb(groups, lr=lr, betas=betas, eps=eps, **lamb_args)
        _keep_trust_ratio_bounds(optimizer)
        return optimizer
    if cuda:
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
    # PyTorch's fused AdamW kernel (CPU too): one pass over the weights instead of one per foreach op
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)


def _keep_trust_ratio_bounds(optimizer: torch.optim.Optimizer) -> None:
    """Loading optimizer state replaces each group's settings with the saved ones; the trust-ratio bounds
    must stay the config's, or a checkpoint from before a change of optim.temperature_trust_ratio (or from
    before the key existed) would silently bring the old temperature step back."""
    bounds = [(g["max_coeff"], g["min_coeff"]) for g in optimizer.param_groups]

    def restore(opt: torch.optim.Optimizer) -> None:
        for group, (high, low) in zip(opt.param_groups, bounds, strict=True):
            group.update(max_coeff=high, min_coeff=low)

    optimizer.register_load_state_dict_post_hook(restore)


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """lr multiplier for optimizer step ``step`` (0-based): linear warm-up to 1, then cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """:func:`warmup_cosine` as LambdaLR's multiplier, for a run whose length may change on resume.

    LambdaLR saves the attributes of a callable object with its state, so a checkpoint carries the length
    its schedule was built for. A resumed run of another length (``train.steps`` or ``train.epochs``
    changed) calls :meth:`retarget`: the rest of the cosine is stretched (or squeezed) over the new
    remaining steps from the point it had reached, so the lr goes on from where it stood. The warm-up
    does not depend on the length and is never changed.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        # the cosine's progress p is linear in the step from (anchor_step, anchor_progress) to (total, 1)
        self.anchor_step, self.anchor_progress = warmup, 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, self.progress(step))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def progress(self, step: int) -> float:
        """How far the cosine has come at ``step`` (0: its start, 1 and above: its end)."""
        span = max(1, self.total - self.anchor_step)
        return self.anchor_progress + (1.0 - self.anchor_progress) * (step - self.anchor_step) / span

    def retarget(self, step: int, total: int) -> None:
        """From ``step`` (the next optimizer step) on, end the cosine at ``total`` instead: the multiplier
        at ``step`` stays what it was."""
        if total == self.total:
            return
        if step > self.warmup:
            self.anchor_step, self.anchor_progress = step, min(1.0, self.progress(step))
        self.total = total


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ExperimentConfig, total_steps: int):
    """The warm-up + cosine schedule, applied to each group's own peak lr (so per-group ratios hold);
    the temperature's own group (rgcl_g) keeps a constant lr."""
    schedule = WarmupCosine(cfg.optim.warmup_steps, total_steps, cfg.optim.min_lr_ratio)
    lambdas = [_constant if g.get("name") == TEMPERATURE_GROUP else schedule for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def retarget_schedule(scheduler, step: int, total_steps: int) -> WarmupCosine | None:
    """After loading a checkpoint: stretch the decay to ``total_steps`` (see :class:`WarmupCosine`).
    Returns the schedule as it was saved (None if the scheduler has none of ours)."""
    ours = [fn for fn in scheduler.lr_lambdas if isinstance(fn, WarmupCosine)]
    if not ours:
        return None
    saved = copy.copy(ours[0])
    for fn in {id(fn): fn for fn in ours}.values():  # the groups share one object
        fn.retarget(step, total_steps)
    return saved


def _constant(step: int) -> float:
    return 1.0


def initialize_engine(
    model: nn.Module,
    cfg: ExperimentConfig,
    ds: dict[str, Any],
    total_steps: int,
    temperature_lr: float | None = None,
):
    """``deepspeed.initialize`` with our optimizer and schedule; returns the engine.

    Per-tensor LAMB learns here which fragments of which tensors DeepSpeed's flat ZeRO partitions hold
    (engine/lamb.py). They depend only on this engine's layout, which a checkpoint load keeps, so a run
    resumed on another number of ranks gets its own from its own engine.
    """
    import deepspeed

    from eva_fastclip.engine.lamb import Lamb, attach_zero_partitions

    cuda = torch.cuda.is_available()
    optimizer = build_optimizer(ds, model, cfg.optim, cuda=cuda, temperature_lr=temperature_lr)
    tensors = [p for group in optimizer.param_groups for p in group["params"]]  # before ZeRO flattens them
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    engine_config = {k: v for k, v in ds.items() if k != "optimizer"}
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=engine_config
    )
    _undo_warm_up_step(engine)
    _running_statistics_in_module_dtype(engine.module)
    if isinstance(optimizer, Lamb) and cfg.optim.lamb_trust_ratio == "per_tensor":
        attach_zero_partitions(optimizer, tensors)
    return engine


def _running_statistics_in_module_dtype(module: nn.Module) -> None:
    """DeepSpeed's bf16 / fp16 engines cast a module's parameters but not its buffers, so BatchNorm (RN
    towers) would meet bf16 weights with fp32 running statistics, which PyTorch's CPU kernel refuses
    ("expected scalar type BFloat16 but found Float"). Cast the statistics as ``module.to(dtype)`` does."""
    for norm in module.modules():
        if isinstance(norm, nn.modules.batchnorm._NormBase) and norm.weight is not None:
            for name in ("running_mean", "running_var"):
                buffer = getattr(norm, name)
                if buffer is not None and buffer.dtype != norm.weight.dtype:
                    setattr(norm, name, buffer.to(norm.weight.dtype))


def _undo_warm_up_step(engine) -> None:
    """DeepSpeed's fp16 / bf16 optimizers without ZeRO (FP16_UnfusedOptimizer, FP16_Optimizer) call the
    optimizer once at initialize with all-zero gradients, to allocate its state. That is a real step: the
    weight decay moves the fp32 masters (LAMB: by lr x max_coeff x weight decay x |w|) and every step count
    starts at 1. Put the masters back to the module's weights, from which DeepSpeed had just copied them,
    and drop that state, so the first step is the first step, as under ZeRO-1/2 and in fp32."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    wrapper = engine.optimizer
    with torch.no_grad():
        if isinstance(wrapper, FP16_UnfusedOptimizer):
            for low_group, master_group in zip(wrapper.fp16_groups, wrapper.fp32_groups, strict=True):
                for low, master in zip(low_group, master_group, strict=True):
                    master.copy_(low)
        elif isinstance(wrapper, FP16_Optimizer):
            for low_flat, master in zip(wrapper.fp16_groups_flat, wrapper.fp32_groups_flat, strict=True):
                master.copy_(low_flat)
        else:
            return
    engine.basic_optimizer.state.clear()
