"""The experiment config's sections: one typed dataclass per section, and their validation.

Every section is a small dataclass with a comment per field; docs/configuration.md lists the same keys.
Each section checks itself in ``__post_init__``, before any process group starts, and every error names
the key and the fix. Reading a file and ``--set`` overrides into these sections is config/loading.py's.
"""

from __future__ import annotations

import dataclasses
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
    unmasked_final_steps: int = 0
    """The last N optimizer steps train without patch dropout (EVA-CLIP's optional unmasked phase)."""
    vision_checkpoint: str | None = None
    """Local EVA MIM checkpoint for the vision tower (EVA repo, timm or open_clip format); docs/eva.md."""
    text_checkpoint: str | None = None
    """Local text-tower weights: an open_clip checkpoint or OpenAI's CLIP file with the same text tower."""
    text_checkpoint_skip: list[str] = field(default_factory=list)
    """Text-tower tensors (names relative to the tower, e.g. "text_projection") that model.text_checkpoint
    does not load: they keep their fresh initialisation (EVA-CLIP's --skip-list, for the projection)."""
    text_hf_model: str | None = None
    """Local folder of a Hugging Face text encoder (config, weights, tokenizer) to use as the text tower."""
    lock_text: bool = False
    """Freeze the text tower (LiT-style locked-text tuning)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.patch_dropout < 1.0:
            raise ConfigError(f"model.patch_dropout must be in [0, 1), got {self.patch_dropout}")
        _positive("model.unmasked_final_steps", self.unmasked_final_steps, allow_zero=True)
        for key in ("pretrained", "vision_checkpoint", "text_checkpoint"):
            value = getattr(self, key)
            if value is not None and not Path(value).is_file():
                raise ConfigError(
                    f"model.{key}={value!r} is not a local file; eva_fastclip never downloads "
                    "weights: point it at a checkpoint on disk or set it to null"
                )
        if self.text_hf_model is not None and not (Path(self.text_hf_model) / "config.json").is_file():
            raise ConfigError(
                f"model.text_hf_model={self.text_hf_model!r} is not a local Hugging Face model folder "
                "(no config.json in it); nothing is downloaded: export the model to a folder first"
            )
        if self.text_hf_model is not None and self.text_checkpoint is not None:
            raise ConfigError("model.text_hf_model and model.text_checkpoint both set: choose one text tower")
        if self.text_checkpoint_skip and self.text_checkpoint is None:
            raise ConfigError(
                f"model.text_checkpoint_skip={self.text_checkpoint_skip} names tensors of "
                "model.text_checkpoint, which is not set: set it, or remove the skip list"
            )


@dataclass(kw_only=True, slots=True)
class DataConfig:
    train_shards: list[str] = field(default_factory=lambda: ["data/toy/train"])
    """Shard sources: brace patterns ("dir/{00000..00331}.tar") or folders (the shards our manifest.json
    lists, else every *.tar)."""
    train_weights: list[float] | None = None
    """Sampling weight per source (resampled mode only)."""
    resampled: bool = False
    """Draw shards with replacement (an endless stream cut into epochs) instead of once per epoch."""
    num_samples: int | None = None
    """Samples per epoch; null: read from the data (our manifest.json, img2dataset's *_stats.json,
    OpenCLIP's sizes.json or __len__)."""
    index_size: int | None = None
    """Rows of the per-sample table, above every sample's index (FastCLIP's data_size); null: read from
    our manifest.json or img2dataset's *.parquet. Only losses with per-sample state use it."""
    shuffle_buffer: int = 1000
    """Samples held in the shuffle buffer of each loader worker."""
    workers: int = 2
    """Loader worker processes per rank."""
    index_key: str = "key"
    """Field of each sample's .json holding its stable dataset index: an integer or a string of digits
    (img2dataset's "key", e.g. "000010005"; make-shards writes it too)."""
    image_decode: str = "workers"
    """Where training JPEGs are decoded: "workers" (the loader workers, on the CPU) or "gpu" (nvjpeg on the
    rank's GPU, cropped and resized there; the workers only read headers and draw the crops)."""
    caption_keys: list[str] = field(default_factory=lambda: ["txt"])
    """Where a sample's captions are: member extensions ("txt", "caption") or fields of its .json
    ("json:recaption"). Without data.caption_weights the first a sample has is its caption (a priority
    order); evaluation on shards of this layout reads the first key."""
    caption_weights: list[float] | None = None
    """One weight per caption key: each sample's caption is drawn among the keys it has by their weights,
    seeded by the sample and the epoch (the same on any layout and on resume); null: the priority order."""
    read_retries: int = 6
    """Times a failed request for a remote shard's bytes is made again (a cut connection, a 5xx, a stall),
    from the first byte not yet read; then the run saves and stops, naming the shard and the byte."""
    retry_wait_s: float = 1.0
    """The wait before the first retry; each next one waits twice as long (6 retries: about a minute)."""

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
        _check_caption_keys(self.caption_keys, self.caption_weights)
        _positive("data.read_retries", self.read_retries, allow_zero=True)
        _positive("data.retry_wait_s", self.retry_wait_s, allow_zero=True)
        if self.num_samples is not None:
            _positive("data.num_samples", self.num_samples)
        if self.index_size is not None:
            _positive("data.index_size", self.index_size)
        if not self.index_key:
            raise ConfigError('data.index_key is empty: name the .json field of the index, e.g. "key"')
        if self.image_decode not in IMAGE_DECODE:
            raise ConfigError(f"data.image_decode must be one of {IMAGE_DECODE}, got {self.image_decode!r}")


#: Each loss's defaults: the values of FastCLIP's published runs (its README and code; docs/recipes.md);
#: a LossConfig key left null takes these. temperature_rule: fixed | learnable (through the loss,
#: OpenCLIP / v0) | rgcl_g (v3) | individual_adam (v2, and iSogCLR as FastCLIP's code runs it) |
#: individual_momentum (iSogCLR's own rule).
LOSS_DEFAULTS: dict[str, dict[str, Any]] = {
    "openclip": {"temperature_rule": "learnable", "temperature_init": 0.07},
    # SigLIP's t = 10 and b = -10, as open_clip's --siglip sets them (docs/recipes.md, Loss defaults: siglip)
    "siglip": {"temperature_rule": "learnable", "temperature_init": 0.1, "logit_bias_init": -10.0},
    "sogclr": {
        "temperature_rule": "fixed",
        "temperature_init": 0.07,
        "gamma_schedule": "constant",
        "gamma_min": 0.9,
    },
    "fastclip_v0": {"temperature_rule": "learnable", "temperature_init": 0.07},
    "fastclip_v1": {"temperature_rule": "fixed", "temperature_init": 0.07},
    "fastclip_v2": {
        "temperature_rule": "individual_adam",
        "temperature_init": 0.03,
        "temperature_lr": 0.0133,
        "rho": 7.0,
    },
    "fastclip_v3": {
        "temperature_rule": "rgcl_g",
        "temperature_init": 0.07,
        "temperature_lr": 2e-4,
        "temperature_lr_drop_below": 0.03,
        "rho": 6.5,
    },
    "isogclr": {  # FastCLIP-v2's loss and tau rule with a constant gamma (FastCLIP's README)
        "temperature_rule": "individual_adam",
        "temperature_init": 0.03,
        "temperature_lr": 0.0133,
        "rho": 7.0,
        "gamma_schedule": "constant",
        "gamma_min": 0.9,
    },
}
#: Defaults of a (loss, rule) pair other than the loss's own rule: iSogCLR's momentum rule, its own lr.
_RULE_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    ("isogclr", "individual_momentum"): {"temperature_lr": 0.03},
}
#: Keys only the compositional losses read (per-sample state, their temperature rules): set under
#: loss.name=siglip, a config meant for another loss is stopped by name. siglip's own keys -> its name.
_COMPOSITIONAL_ONLY_KEYS = (
    "temperature_lr", "temperature_lr_drop_below", "temperature_lr_drop_factor", "temperature_lr_drop_rule",
    "temperature_betas", "temperature_momentum", "temperature_grad_clip", "gamma_schedule", "gamma_min",
    "gamma_decay_epochs", "rho", "eps", "tau_gradient",
)  # fmt: skip
_SIGLIP_ONLY_KEYS = ("logit_bias_init",)
#: losses without per-sample state or an inner rate: the mini-batch ones
MINI_BATCH_LOSSES = ("openclip", "siglip")
#: Defaults shared by the compositional losses (every name but "openclip" and "siglip").
_COMPOSITIONAL_DEFAULTS: dict[str, Any] = {
    "gamma_schedule": "cosine",
    "gamma_min": 0.2,
    "eps": 1e-14,
}
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
CONTRASTIVE_BATCHES = ("micro", "global")
#: signals train.preempt_signal may name: catchable, and not already caught or the loader's
PREEMPT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGXCPU")
TEMPERATURE_RULES = ("fixed", "learnable", "rgcl_g", "individual_adam", "individual_momentum")
#: how the rgcl_g rule takes tau's gradient: the objective's, or what FastCLIP's code computes
TAU_GRADIENTS = ("exact", "fastclip_code")
#: rgcl_g's temperature-lr drop: while tau is at or below the threshold (FastCLIP's scheduler), or for
#: good from the first time it is (SPEC)
TEMPERATURE_LR_DROP_RULES = ("every_step", "once")
#: data.image_decode: where training JPEGs are decoded (data/image_transform.py)
IMAGE_DECODE = ("workers", "gpu")
#: optim.weight_decay_rule: which parameter tensors get weight decay (optim/param_groups.py)
WEIGHT_DECAY_RULES = ("no_embeddings", "fastclip", "eva_clip")
#: optim.lamb_trust_ratio: per model tensor (ours), or per flat ZeRO partition (DeepSpeed's FusedLamb).
LAMB_TRUST_RATIOS = ("per_tensor", "per_zero_partition")


@dataclass(kw_only=True, slots=True)
class LossConfig:
    name: str = "openclip"
    """openclip, siglip, sogclr, isogclr, fastclip_v0, fastclip_v1, fastclip_v2 or fastclip_v3
    (docs/losses.md)."""
    temperature_rule: str | None = None
    """fixed, learnable, rgcl_g, individual_adam or individual_momentum; null: the loss's own rule."""
    temperature_init: float | None = None
    """Initial temperature tau (global, or every sample's for the individual rules)."""
    temperature_min: float = 0.01
    """Lower bound of tau (the global one is kept in [min, max] after every applied step)."""
    temperature_max: float = 1.0
    """Upper bound of tau."""
    temperature_lr: float | None = None
    """lr of tau: its own constant-lr group (rgcl_g) or the per-sample step (individual rules); null for
    `learnable`: tau shares the model's lr and schedule (FastCLIP-v0: lr_tau = lr)."""
    temperature_lr_drop_below: float | None = None
    """rgcl_g: when tau <= this value, tau's lr is multiplied by temperature_lr_drop_factor; > 0."""
    temperature_lr_drop_factor: float = 1.0 / 3.0
    """rgcl_g: factor of the lr drop, in (0, 1]."""
    temperature_lr_drop_rule: str = "every_step"
    """rgcl_g: "every_step" (tau's lr is checked before every step: dropped while tau <= the threshold,
    back up when tau climbs above it, as FastCLIP's scheduler does) or "once" (dropped for good)."""
    temperature_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """individual_adam: Adam's (beta1, beta2) for the per-sample tau."""
    temperature_momentum: float = 0.5
    """individual_momentum: m <- momentum*m + (1-momentum)*grad (iSogCLR)."""
    temperature_grad_clip: float = 5.0
    """Individual rules: per-sample tau gradients are clamped to [-clip, clip]; > 0."""
    gamma_schedule: str | None = None
    """Inner rate gamma of the u estimators: "cosine" (1 -> gamma_min over gamma_decay_epochs) or
    "constant" (gamma_min); gamma is 1 in the first epoch either way."""
    gamma_min: float | None = None
    """Final / constant gamma (FastCLIP 0.2, SogCLR 0.9)."""
    gamma_decay_epochs: int | None = None
    """Epochs of the cosine decay of gamma; null: half the run's epochs (train.epochs, or as many as
    train.steps takes on the data and ranks of the run, which the trainer works out)."""
    rho: float | None = None
    """rho of the robust objectives RGCL (v2, iSogCLR) and RGCL-g (v3): 6.5 CC3M, 8.5 CC12M, 16 LAION."""
    eps: float | None = None
    """epsilon inside log(eps + g) and g / (u + eps): 1e-14 (1e-6 for LAION-scale runs)."""
    tau_gradient: str | None = None
    """rgcl_g only: "fastclip_code" (FastCLIP's code: the surrogate's tau-derivative counted twice, log u
    without eps; its published v3 runs and rho values) or "exact" (the gradient of RGCL-g; docs/losses.md);
    null: fastclip_code for rgcl_g, exact for every other rule."""
    logit_bias_init: float | None = None
    """siglip only: the initial bias b of the sigmoid's logits, a learned model parameter (SigLIP: -10,
    with the scale t = 1/temperature_init = 10)."""

    def __post_init__(self) -> None:
        if self.name not in LOSS_DEFAULTS:
            raise ConfigError(f"loss.name={self.name!r} is unknown; choose one of {sorted(LOSS_DEFAULTS)}")
        self._check_keys_of_other_losses()
        defaults = dict(LOSS_DEFAULTS[self.name])
        if self.is_compositional:
            defaults = {**_COMPOSITIONAL_DEFAULTS, **defaults}
        rule = self.temperature_rule or defaults["temperature_rule"]
        defaults.update(_RULE_DEFAULTS.get((self.name, rule), {}))
        for key, value in defaults.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.temperature_rule not in TEMPERATURE_RULES:
            raise ConfigError(f"loss.temperature_rule must be one of {TEMPERATURE_RULES}")
        if not self.is_compositional and self.temperature_rule not in ("fixed", "learnable"):
            raise ConfigError(f"loss.name={self.name} supports temperature_rule fixed or learnable")
        if self.temperature_rule.startswith("individual") != (self.name in ("fastclip_v2", "isogclr")):
            raise ConfigError(
                f"loss.temperature_rule={self.temperature_rule} does not fit loss.name={self.name}: "
                "individual temperatures need the RGCL losses fastclip_v2 or isogclr, and those need an "
                "individual rule"
            )
        if not 0.0 < self.temperature_min <= self.temperature_init <= self.temperature_max:
            raise ConfigError(
                "loss.temperature_init must lie in [loss.temperature_min, loss.temperature_max] and "
                f"temperature_min must be > 0; got {self.temperature_init} in "
                f"[{self.temperature_min}, {self.temperature_max}]"
            )
        if self.temperature_rule in ("rgcl_g", "individual_adam", "individual_momentum"):
            if self.temperature_lr is None or self.temperature_lr <= 0:
                raise ConfigError(
                    f"loss.temperature_lr must be > 0 for temperature_rule={self.temperature_rule}"
                )
            if self.rho is None:
                raise ConfigError(f"loss.rho must be set for temperature_rule={self.temperature_rule}")
        if len(self.temperature_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.temperature_betas):
            raise ConfigError("loss.temperature_betas must be two numbers in [0, 1)")
        if not 0.0 <= self.temperature_momentum < 1.0:
            raise ConfigError("loss.temperature_momentum must be in [0, 1)")
        # a negative clip would clamp every per-sample tau gradient to -clip, a constant push
        _positive("loss.temperature_grad_clip", self.temperature_grad_clip)
        if not 0.0 < self.temperature_lr_drop_factor <= 1.0:
            raise ConfigError(
                "loss.temperature_lr_drop_factor must be in (0, 1] (it multiplies tau's lr once tau falls "
                f"to loss.temperature_lr_drop_below; FastCLIP: 1/3), got {self.temperature_lr_drop_factor}"
            )
        if self.temperature_lr_drop_below is not None:
            _positive("loss.temperature_lr_drop_below", self.temperature_lr_drop_below)
        if self.temperature_lr_drop_rule not in TEMPERATURE_LR_DROP_RULES:
            raise ConfigError(
                f"loss.temperature_lr_drop_rule must be one of {TEMPERATURE_LR_DROP_RULES}, "
                f"got {self.temperature_lr_drop_rule!r}"
            )
        if self.is_compositional:
            if self.gamma_schedule not in ("cosine", "constant"):
                raise ConfigError(
                    f"loss.gamma_schedule must be cosine or constant, got {self.gamma_schedule!r}"
                )
            if not 0.0 < self.gamma_min <= 1.0:
                raise ConfigError(f"loss.gamma_min must be in (0, 1], got {self.gamma_min}")
            if self.eps is None or self.eps <= 0:
                raise ConfigError("loss.eps must be > 0")
            if self.gamma_decay_epochs is not None:
                _positive("loss.gamma_decay_epochs", self.gamma_decay_epochs)
        if self.tau_gradient is None:
            self.tau_gradient = "fastclip_code" if self.temperature_rule == "rgcl_g" else "exact"
        if self.tau_gradient not in TAU_GRADIENTS:
            raise ConfigError(f"loss.tau_gradient must be one of {TAU_GRADIENTS}, got {self.tau_gradient!r}")
        if self.tau_gradient != "exact" and self.temperature_rule != "rgcl_g":
            raise ConfigError(
                f"loss.tau_gradient={self.tau_gradient} applies only to temperature_rule=rgcl_g "
                f"(fastclip_v3), not {self.temperature_rule}: remove the key or set it to exact"
            )

    @property
    def is_compositional(self) -> bool:
        """Whether the loss keeps per-sample state (every loss but the mini-batch ones)."""
        return self.name not in MINI_BATCH_LOSSES

    def _check_keys_of_other_losses(self) -> None:
        """A key set (not at its default) that this loss does not read stops the run, naming it."""
        defaults = {
            f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(self)
        }
        defaults["tau_gradient"] = "exact"  # what every rule but rgcl_g resolves it to (a saved config's)
        if self.name == "siglip":
            foreign = [k for k in _COMPOSITIONAL_ONLY_KEYS if getattr(self, k) not in (defaults[k], None)]
            reader = "the compositional losses (sogclr, isogclr, fastclip_v0-v3)"
        else:
            foreign = [k for k in _SIGLIP_ONLY_KEYS if getattr(self, k) != defaults[k]]
            reader = "loss.name=siglip"
        if foreign:
            raise ConfigError(
                f"loss.{foreign[0]} is read only by {reader}, not by loss.name={self.name}: remove it "
                "(a config written for another loss?)"
            )


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate; fills "lr": "auto" in the DeepSpeed JSON's optimizer section."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the tensors optim.weight_decay_rule picks; the temperature gets none."""
    weight_decay_rule: str = "no_embeddings"
    """Which tensors get weight decay: "no_embeddings" (matrices, but not embeddings, position embeddings
    or class tokens), "fastclip" (all but 1-D tensors and names with bn, ln or bias: FastCLIP's and
    OpenCLIP's rule) or "eva_clip" (all but 1-D tensors, *.bias and the towers' position embeddings and
    class tokens: EVA-CLIP's rule, which decays the token embedding)."""
    warmup_steps: int = 100
    """Linear warm-up length in optimizer steps, then cosine decay to lr * min_lr_ratio."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak."""
    visual_lr: float | None = None
    """Peak lr of the vision tower (EVA-CLIP B/16: 2e-4); null: optim.lr."""
    text_lr: float | None = None
    """Peak lr of the text tower (EVA-CLIP B/16: 2e-5); null: optim.lr."""
    visual_weight_decay: float | None = None
    """Weight decay of the vision tower's decayed tensors; null: optim.weight_decay."""
    text_weight_decay: float | None = None
    """Weight decay of the text tower's decayed tensors; null: optim.weight_decay."""
    visual_layer_decay: float = 1.0
    """Layer-wise lr decay of the vision tower: lr * decay^(L+1-l) for layer l of its L blocks (0.75)."""
    text_layer_decay: float = 1.0
    """Layer-wise lr decay of the text tower (EVA-CLIP: 0.75)."""
    temperature_trust_ratio: bool = False
    """LAMB: scale the learned temperature's step by its trust ratio like every other tensor's (FusedLamb's
    own behaviour, EVA-CLIP); false: tau steps like Adam (ratio 1), as under FastCLIP's AdamW and LAMB."""
    lamb_trust_ratio: str = "per_tensor"
    """LAMB: the trust ratio of each parameter tensor, the same for any number of ranks and ZeRO stage;
    per_zero_partition: of each flat ZeRO partition of a parameter group, as DeepSpeed's FusedLamb takes it
    (EVA-CLIP's runs), which changes the steps with the number of ranks."""

    def __post_init__(self) -> None:
        _positive("optim.lr", self.lr)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        for tower in ("visual", "text"):
            lr, wd = getattr(self, f"{tower}_lr"), getattr(self, f"{tower}_weight_decay")
            if lr is not None:
                _positive(f"optim.{tower}_lr", lr)
            if wd is not None:
                _positive(f"optim.{tower}_weight_decay", wd, allow_zero=True)
            decay = getattr(self, f"{tower}_layer_decay")
            if not 0.0 < decay <= 1.0:
                raise ConfigError(f"optim.{tower}_layer_decay must be in (0, 1], got {decay}")
        _positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay_rule not in WEIGHT_DECAY_RULES:
            raise ConfigError(
                f"optim.weight_decay_rule must be one of {WEIGHT_DECAY_RULES}, got {self.weight_decay_rule!r}"
            )
        if self.lamb_trust_ratio not in LAMB_TRUST_RATIOS:
            raise ConfigError(
                f"optim.lamb_trust_ratio must be one of {LAMB_TRUST_RATIOS}, got {self.lamb_trust_ratio!r}"
            )


def gamma_decay_epochs_for(epochs: int) -> int:
    """The default horizon of gamma's cosine decay for a run of ``epochs`` epochs: half of them."""
    return max(1, epochs // 2)


def _check_caption_keys(keys: list[str], weights: list[float] | None) -> None:
    if not keys or any(not isinstance(key, str) or key in ("", "json:") for key in keys):
        raise ConfigError(
            'data.caption_keys must name member extensions ("txt") or .json fields ("json:caption"), '
            f"at least one: got {keys}"
        )
    if len(set(keys)) != len(keys):
        raise ConfigError(f"data.caption_keys names a key twice: {keys}")
    if weights is not None and (len(weights) != len(keys) or any(w <= 0 for w in weights)):
        raise ConfigError(
            f"data.caption_weights must be one positive weight per caption key ({keys}), got {weights}"
        )


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key} must be {bound}, got {value}")
