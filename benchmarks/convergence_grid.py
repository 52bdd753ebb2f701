"""The convergence benchmark's grid: the losses compared, the recipe every run shares, and one run's spec.

A run is one (loss variant, global batch, accumulation, seed); everything that must match for a saved
result to count as that run is in its :class:`RunSpec` (benchmarks/convergence.py runs the grid).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: variant name -> (label, config overrides). Each loss runs with its own defaults (config.LOSS_DEFAULTS:
#: the values FastCLIP's code runs); FastCLIP-v3 also with RGCL-g's exact τ-gradient, an option.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "openclip": ("OpenCLIP", {"loss.name": "openclip"}),
    "fastclip_v1": ("FastCLIP-v1", {"loss.name": "fastclip_v1"}),
    "fastclip_v3": ("FastCLIP-v3", {"loss.name": "fastclip_v3"}),
    "fastclip_v3_exact": (
        "FastCLIP-v3 (exact τ-gradient)",
        {"loss.name": "fastclip_v3", "loss.tau_gradient": "exact"},
    ),
    "sogclr": ("SogCLR", {"loss.name": "sogclr"}),
    "isogclr": ("iSogCLR", {"loss.name": "isogclr"}),
    # SigLIP's t = 10 and b = -10 (its defaults: a base config's temperature_init would override t)
    "siglip": ("SigLIP", {"loss.name": "siglip", "loss.temperature_init": 0.1}),
}
REFERENCE = "fastclip_v3"
DEFAULT_MODEL = "bench-vit-xs"
#: the recipe every run shares: FastCLIP's CC3M recipe (AdamW, lr 1e-3, wd 0.1, cosine to 0) with its
#: ViT optimizer defaults, weight-decay rule and no gradient clipping (docs/recipes.md).
RECIPE: dict[str, Any] = {
    "train.deepspeed_config": "ds_configs/fastclip_adamw_vit.json",
    "train.precision": "fp32",  # explicit: the same numerics on every machine (auto picks bf16 on some)
    "optim.lr": 1e-3,
    "optim.weight_decay": 0.1,
    "optim.weight_decay_rule": "fastclip",
    "optim.min_lr_ratio": 0.0,
    "train.save_every_steps": 0,
    "train.keep_checkpoints": 1,
    # the held-out drawings decode in the run's process: loader workers would be spawned (the runs are)
    # at every evaluation, costing more CPU than the training steps; the results are the same
    "eval.workers": 0,
}
#: bumped when a change of RECIPE or VARIANTS changes results (not e.g. eval.workers, which only moves the
#: decoding between processes), so results of an older recipe are never mixed with new ones.
#: 1: 2026-11-23 (zero1_adamw.json, clipping 1.0, v3 exact τ-gradient, one-time τ-lr drop, iSogCLR's
#: momentum rule); 2: 2026-11-25 (the corrected defaults above).
RECIPE_VERSION = 2
#: what the curves and tables show: key of the evaluation results (TensorBoard: eval/<key>) -> title
METRICS: dict[str, str] = {
    "zeroshot_top1": "zero-shot top-1",
    "retrieval_image_to_text_R@1": "image→text R@1",
    "retrieval_text_to_image_R@1": "text→image R@1",
}
CHANCE_KEYS = {
    "zeroshot_top1": "zeroshot_top1_chance",
    "retrieval_image_to_text_R@1": "retrieval_R@1_chance",
    "retrieval_text_to_image_R@1": "retrieval_R@1_chance",
}


@dataclass(frozen=True)
class RunSpec:
    """One run; everything that must match for a saved result to count as this run."""

    variant: str
    batch: int
    seed: int
    epochs: int
    model: str
    eval_every_epochs: int
    warmup_epochs: int
    num_train: int
    image_size: int
    recipe_version: int = RECIPE_VERSION
    accumulate: int = 1  # micro-batches of batch / accumulate per optimizer step
    contrastive: str = "micro"  # train.contrastive_batch, where accumulate > 1

    @property
    def name(self) -> str:
        layout = "" if self.accumulate == 1 else f"-a{self.accumulate}{self.contrastive}"
        return f"{self.variant}-b{self.batch}{layout}-s{self.seed}"

    @property
    def steps_per_epoch(self) -> int:
        return self.num_train // self.batch

    def overrides(self, data_dir: Path, run_dir: Path) -> list[str]:
        steps = self.steps_per_epoch
        values = {
            **RECIPE,
            **VARIANTS[self.variant][1],
            "model.name": self.model,
            "data.train_shards": [str(data_dir / "train")],
            "eval.retrieval_shards": [str(data_dir / "val")],
            "eval.zeroshot_dir": str(data_dir / "zeroshot"),
            "eval.every_steps": steps * self.eval_every_epochs,
            "optim.warmup_steps": steps * self.warmup_epochs,
            "train.batch_size": self.batch // self.accumulate,
            "train.grad_accum_steps": self.accumulate,
            "train.contrastive_batch": self.contrastive,
            "train.epochs": self.epochs,
            "train.seed": self.seed,
            "train.output_dir": str(run_dir),
            "train.log_every_steps": steps,  # one temperature point per epoch
        }
        return [f"{key}={json.dumps(value)}" for key, value in values.items()]


def plan_runs(
    variants: list[str],
    batches: list[int],
    seeds: list[int],
    layouts: list[tuple[int, str]] = ((1, "micro"),),
    **common: Any,
) -> list[RunSpec]:
    """Seed-major order: an interrupted benchmark has whole seeds of every variant, not some variants.
    ``layouts``: (micro-batches a step, train.contrastive_batch) of each batch."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    for batch, (accumulate, _) in itertools.product(batches, layouts):
        if batch % accumulate:
            raise ValueError(f"batch {batch} does not split into {accumulate} micro-batches")
    return [
        RunSpec(variant=v, batch=b, seed=s, accumulate=a, contrastive=c, **common)
        for s in seeds
        for b in batches
        for a, c in layouts
        for v in variants
    ]
