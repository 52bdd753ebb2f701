"""Typed experiment configuration: load JSON, apply ``--set`` overrides, validate.

- config/sections.py: the sections of what is trained (model, data, loss, optim) as typed dataclasses
  and their validation; the losses' defaults and each key's choices.
- config/run_sections.py: the sections of how the run goes (train, eval) and the experiment that holds
  every section.
- config/loading.py: reading the JSON file, the ``--set`` overrides, building the sections from them.

Every name is importable from ``eva_fastclip.config``. The batch layout derived from a config is
eva_fastclip/plan/layout.py's.
"""

from .loading import TUNED_SECTION, config_from_raw, from_dict, load_config, read_raw_config
from .run_sections import EvalConfig, ExperimentConfig, TrainConfig
from .sections import (
    CONTRASTIVE_BATCHES,
    IMAGE_DECODE,
    LAMB_TRUST_RATIOS,
    LOSS_DEFAULTS,
    PRECISIONS,
    PREEMPT_SIGNALS,
    TAU_GRADIENTS,
    TEMPERATURE_LR_DROP_RULES,
    TEMPERATURE_RULES,
    WEIGHT_DECAY_RULES,
    ConfigError,
    DataConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    gamma_decay_epochs_for,
)

__all__ = [
    "CONTRASTIVE_BATCHES",
    "IMAGE_DECODE",
    "LAMB_TRUST_RATIOS",
    "LOSS_DEFAULTS",
    "PRECISIONS",
    "PREEMPT_SIGNALS",
    "TAU_GRADIENTS",
    "TEMPERATURE_LR_DROP_RULES",
    "TEMPERATURE_RULES",
    "TUNED_SECTION",
    "WEIGHT_DECAY_RULES",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ExperimentConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "config_from_raw",
    "from_dict",
    "gamma_decay_epochs_for",
    "load_config",
    "read_raw_config",
]
