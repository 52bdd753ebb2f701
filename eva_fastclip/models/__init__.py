"""Models: open_clip architectures (and the tiny ones shipped here), EVA and text-tower weights from local
files, the token-masking switch and kernel selection."""

from eva_fastclip.models.eva import VisionLoadReport, load_vision_checkpoint, load_vision_tower
from eva_fastclip.models.factory import (
    SCALAR_PARAMETERS,
    ModelBundle,
    create_model,
    make_logit_scale_1d,
    to_open_clip_state_dict,
)

__all__ = [
    "SCALAR_PARAMETERS",
    "ModelBundle",
    "VisionLoadReport",
    "create_model",
    "load_vision_checkpoint",
    "load_vision_tower",
    "make_logit_scale_1d",
    "to_open_clip_state_dict",
]
