"""Typed experiment configuration: load JSON, apply ``--set`` overrides, validate, derive batch sizes.

Every section is a small dataclass with a comment per field; docs/configuration.md lists the same keys.
Validation happens here, before any process group starts, and every error names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and how to fix it."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    name: str = "toy-vit-t"
    """open_clip architecture name (ViT-B-16, EVA02-B-16, ...) or one in eva_fastclip/models/configs."""
    pretrained: str | None = None
    """Local open_clip-format checkpoint file to start from; nothing is ever downloaded."""
    patch_dropout: float = 0.0
    """Fraction of patch tokens dropped at random in training (FLIP, EVA-CLIP: 0.5); never at eval."""
    grad_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.patch_dropout < 1.0:
            raise ConfigError(f"model.patch_dropout must be in [0, 1), got {self.patch_dropout}")
        if self.pretrained is not None and not Path(self.pretrained).is_file():
            raise ConfigError(
                f"model.pretrained={self.pretrained!r} is not a local file; eva_fastclip never downloads "
                "weights: point it at an open_clip checkpoint on disk or set it to null"
            )


@dataclass(kw_only=True, slots=True)
class DataConfig:
    train_shards: list[str] = field(default_factory=lambda: ["data/toy/train"])
    """Shard sources: brace patterns ("dir/shard-{000000..000099}.tar") or folders with a manifest.json."""
    train_weights: list[float] | None = None
    """Sampling weight per source (resampled mode only)."""
    resampled: bool = False
    """Draw shards with replacement (an endless stream cut into epochs) instead of once per epoch."""
    num_samples: int | None = None
    """Samples per epoch; read from the sources' manifests when null."""
    shuffle_buffer: int = 1000
    """Samples held in the shuffle buffer of each loader worker."""
    workers: int = 2
    """Loader worker processes per rank."""
    index_key: str = "index"
    """Key of the integer dataset index in each sample's .json (stable across epochs and restarts)."""

    def __post_init__(self) -> None:
        if not self.train_shards:
            raise ConfigError("data.train_shards is empty: give at least one shard pattern or folder")
        if self.train_weights is not None:
            if len(self.train_weights) != len(self.train_shards):
                raise ConfigError(
                    f"data.train_weights has {len(self.train_weights)} entries but data.train_shards has "
                    f"{len(self.train_shards)}: give one weight per source"
                )
            if not self.resampled:
                raise ConfigError(
                    "data.train_weights needs data.resampled=true (weights mix resampled sources)"
                )
        _positive("data.shuffle_buffer", self.shuffle_buffer, allow_zero=True)
        _positive("data.workers", self.workers, allow_zero=True)
        if self.num_samples is not None:
            _positive("data.num_samples", self.num_samples)


@dataclass(kw_only=True, slots=True)
class LossConfig:
    name: str = "openclip"
    """Loss registered in eva_fastclip.losses (see `eva-fastclip train --help` or docs/configuration.md)."""
    temperature_init: float = 0.07
    """Initial temperature tau (the model's logit_scale starts at log(1/tau))."""
    learn_temperature: bool = True
    """Learn the global temperature through the loss (OpenCLIP); false keeps it fixed."""

    def __post_init__(self) -> None:
        if not 0.0 < self.temperature_init <= 1.0:
            raise ConfigError(f"loss.temperature_init must be in (0, 1], got {self.temperature_init}")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate; fills "lr": "auto" in the DeepSpeed JSON's optimizer section."""
    weight_decay: float = 0.1
    """Decoupled weight decay for weight matrices; biases, norms, embeddings and the temperature get none."""
    warmup_steps: int = 100
    """Linear warm-up length in optimizer steps, then cosine decay to lr * min_lr_ratio."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak."""

    def __post_init__(self) -> None:
        _positive("optim.lr", self.lr)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        _positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    zeroshot_dir: str | None = None
    """clip_benchmark-layout classification folder (test/*.tar, classnames.txt, templates)."""
    retrieval_shards: list[str] | None = None
    """Held-out image-text shards for image<->text retrieval."""
    every_steps: int = 0
    """Evaluate every N optimizer steps (0: only at the end of training)."""
    batch_size: int = 128
    """Evaluation batch size."""

    def __post_init__(self) -> None:
        _positive("eval.every_steps", self.every_steps, allow_zero=True)
        _positive("eval.batch_size", self.batch_size)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    deepspeed_config: str = "ds_configs/zero1_bf16_lamb.json"
    """DeepSpeed JSON: ZeRO stage, precision, clipping, optimizer type. Batch sizes there may be "auto"."""
    batch_size: int = 64
    """Micro-batch per rank (DeepSpeed's train_micro_batch_size_per_gpu)."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (DeepSpeed's gradient_accumulation_steps)."""
    epochs: int = 1
    """Passes over data.num_samples; ignored when `steps` is set."""
    steps: int | None = None
    """Total optimizer steps; overrides `epochs`."""
    seed: int = 0
    """Seed for model init, data order and masking."""
    output_dir: str = "runs/default"
    """Checkpoints (output_dir/checkpoints), TensorBoard logs (output_dir/tensorboard), final metrics."""
    save_every_steps: int = 0
    """Save a sharded checkpoint every N optimizer steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept; older ones are deleted only after a newer one is complete."""
    log_every_steps: int = 10
    """TensorBoard / console logging period in optimizer steps."""

    def __post_init__(self) -> None:
        _positive("train.batch_size", self.batch_size)
        _positive("train.grad_accum_steps", self.grad_accum_steps)
        _positive("train.epochs", self.epochs)
        if self.steps is not None:
            _positive("train.steps", self.steps)
        _positive("train.save_every_steps", self.save_every_steps, allow_zero=True)
        _positive("train.keep_checkpoints", self.keep_checkpoints)
        _positive("train.log_every_steps", self.log_every_steps)


@dataclass(kw_only=True, slots=True)
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        from eva_fastclip.losses import LOSSES  # late import: the registry imports torch

        if self.loss.name not in LOSSES:
            raise ConfigError(f"loss.name={self.loss.name!r} is unknown; choose one of {sorted(LOSSES)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key} must be {bound}, got {value}")


# ---- loading ---------------------------------------------------------------------------------------


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> ExperimentConfig:
    """Read a JSON experiment config (or the defaults), apply ``key.sub=value`` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"config file {path} is not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a JSON object at the top level")
    for item in overrides:
        _apply_override(raw, item)
    return from_dict(ExperimentConfig, raw, prefix="")


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r} must look like section.key=value, e.g. train.batch_size=32")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text  # bare strings need no quotes on the command line
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is not a section")
    node[leaf] = value


def from_dict(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """Build dataclass ``cls`` from ``raw``, rejecting unknown keys and wrong types with the key named."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a JSON object, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key {prefix + key!r}{hint}")
        kwargs[key] = _coerce(hints[key], value, prefix + key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {err}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, prefix=key + ".")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(option, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} must be a list, got {value!r}")
        (item_hint,) = typing.get_args(hint)
        return [_coerce(item_hint, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and not _is_fake_int(hint, value)):
        raise ConfigError(f"config key {key!r} must be {hint.__name__}, got {value!r}")
    return value


def _is_fake_int(hint: type, value: Any) -> bool:
    # bool is a subclass of int in Python, but `"batch_size": true` is a mistake, not a number
    return hint is int and isinstance(value, bool)


# ---- batch sizes -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """The one place where micro-batch, accumulation and world size become the global batch."""

    micro_batch: int
    grad_accum_steps: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum_steps * self.world_size

    @property
    def samples_per_forward(self) -> int:
        """Pairs that one loss evaluation sees across ranks (the negatives of each anchor)."""
        return self.micro_batch * self.world_size


def batch_layout(cfg: ExperimentConfig, world_size: int) -> BatchLayout:
    return BatchLayout(cfg.train.batch_size, cfg.train.grad_accum_steps, world_size)
