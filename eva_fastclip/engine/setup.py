"""DeepSpeed's engine: ``deepspeed.initialize`` with our optimizer and schedule, and what it gets wrong.

The resolved DeepSpeed JSON (plan/deepspeed_json.py) and the optimizer (optim/) come in; the engine comes
out with the first step really the first (no warm-up step of its fp16/bf16 wrappers), BatchNorm's running
statistics in the module's dtype, per-tensor LAMB told which ZeRO partition holds which tensor, and, where
no DeepSpeed wrapper stands between the engine and the optimizer (ZeRO-0 in fp32 or by autocast), the
clipping and the non-finite guard in the optimizer's own step (optim/step_guard.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from eva_fastclip.config import ExperimentConfig
from eva_fastclip.optim.optimizer import build_optimizer
from eva_fastclip.optim.schedule import build_scheduler


def initialize_engine(
    model: nn.Module,
    cfg: ExperimentConfig,
    ds: dict[str, Any],
    total_steps: int,
    temperature_lr: float | None = None,
):
    """``deepspeed.initialize`` with our optimizer and schedule; returns the engine.

    Per-tensor LAMB learns here which fragments of which tensors DeepSpeed's flat ZeRO partitions hold
    (optim/lamb.py). They depend only on this engine's layout, which a checkpoint load keeps, so a run
    resumed on another number of ranks gets its own from its own engine.
    """
    import deepspeed

    from eva_fastclip.optim.lamb import Lamb, attach_zero_partitions

    cuda = torch.cuda.is_available()
    optimizer = build_optimizer(ds, model, cfg.optim, cuda=cuda, temperature_lr=temperature_lr)
    tensors = [p for group in optimizer.param_groups for p in group["params"]]  # before ZeRO flattens them
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    engine_config = {k: v for k, v in ds.items() if k != "optimizer"}
    unwrapped = steps_model_tensors(ds)
    if unwrapped:  # the optimizer clips and guards (optim/step_guard.py); DeepSpeed would, tensor by tensor
        optimizer.guard_gradients(ds.get("gradient_clipping", 0.0))
        engine_config["gradient_clipping"] = 0.0
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=engine_config
    )
    if unwrapped and engine.dp_world_size == 1:
        # one rank has nothing to average: DeepSpeed would still copy every gradient into a flat buffer,
        # "all-reduce" it alone and copy it back after each backward
        engine.enable_backward_allreduce = False
    _undo_warm_up_step(engine)
    _running_statistics_in_module_dtype(engine.module)
    if isinstance(optimizer, Lamb) and cfg.optim.lamb_trust_ratio == "per_tensor":
        attach_zero_partitions(optimizer, tensors)
    return engine


def steps_model_tensors(ds: dict[str, Any]) -> bool:
    """Whether DeepSpeed hands the optimizer the model's own tensors, with no wrapper of its own: ZeRO
    stage 0 in fp32, or in bf16 by autocast over fp32 weights (plan/precision.py). Then the step after
    the backward is the optimizer's alone: one gradient norm that clips and guards, and the update."""
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    mixed = any(ds.get(name, {}).get("enabled") is True for name in ("bf16", "fp16"))
    return stage == 0 and not mixed


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


def precision_of(engine) -> str:
    """bf16, fp16 or fp32: the precision ``engine`` trains in (bf16 by DeepSpeed's bf16 or by autocast)."""
    if engine.bfloat16_enabled() or engine.torch_autocast_enabled():
        return "bf16"
    return "fp16" if engine.fp16_enabled() else "fp32"
