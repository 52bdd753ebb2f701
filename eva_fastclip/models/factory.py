"""Build open_clip models, transforms and tokenizers from a ModelConfig, from local files only."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import open_clip
import torch
from torch import nn

from eva_fastclip.config import ModelConfig
from eva_fastclip.models import text_towers
from eva_fastclip.models.eva import load_vision_tower
from eva_fastclip.models.masking import key_patch_dropout

SHIPPED_CONFIGS = Path(__file__).parent / "configs"
open_clip.add_model_config(SHIPPED_CONFIGS)  # makes the tiny test/demo architectures known by name


@dataclass
class ModelBundle:
    model: nn.Module
    preprocess_train: Callable
    preprocess_eval: Callable
    tokenizer: Callable
    embed_dim: int  # the width of both towers' features
    image_shape: tuple[int, int, int]  # (channels, height, width) of the vision tower's input


def create_model(
    cfg: ModelConfig,
    *,
    temperature_init: float = 0.07,
    logit_bias_init: float | None = None,
    device: str | torch.device = "cpu",
) -> ModelBundle:
    """The open_clip model ``cfg.name`` with patch dropout, checkpointing and a 1-element logit_scale.
    ``logit_bias_init`` (SigLIP's loss.logit_bias_init) gives it open_clip's ``logit_bias`` parameter, which
    its forward then returns after logit_scale. ``device="meta"`` (inside ``with torch.device("meta")``):
    its shapes only, no weights allocated or initialised (tune's trace; no checkpoint may be named then)."""
    if cfg.name not in open_clip.list_models():
        raise ValueError(
            f"model.name={cfg.name!r} is not an open_clip architecture; known names include "
            f"{', '.join(open_clip.list_models()[:8])}, ... (open_clip.list_models() lists all)"
        )
    text_kwargs = {}
    if cfg.text_hf_model is not None:  # the folder's encoder replaces the text tower
        text_kwargs = text_towers.hf_text_model_kwargs(  # a full CLIP checkpoint brings its own weights
            cfg.name, cfg.text_hf_model, load_weights=cfg.pretrained is None and str(device) != "meta"
        )
    model, preprocess_train, preprocess_eval = open_clip.create_model_and_transforms(
        cfg.name,
        pretrained=cfg.pretrained,  # a local file or None (checked by ModelConfig): never a download tag
        force_patch_dropout=cfg.patch_dropout,
        pretrained_text=False,  # HF text towers would otherwise fetch weights from the hub
        device=device,
        **text_kwargs,
    )
    if cfg.vision_checkpoint is not None:  # EVA MIM weights into the timm trunk; raises on any backbone gap
        load_vision_tower(model, cfg.vision_checkpoint)
    if cfg.pretrained is None:
        with torch.no_grad():
            model.logit_scale.fill_(math.log(1.0 / temperature_init))
    if logit_bias_init is not None:
        add_logit_bias(model, logit_bias_init, keep_trained=cfg.pretrained is not None)
    if cfg.text_checkpoint is not None:  # OpenCLIP / OpenAI text weights; raises on any transformer gap
        text_towers.load_text_checkpoint(model, cfg.text_checkpoint, skip=cfg.text_checkpoint_skip)
    make_logit_scale_1d(model)
    key_patch_dropout(model)  # a sample's mask from its key inside keyed_masks (the trainer's steps)
    set_grad_checkpointing(model, cfg.grad_checkpointing)
    if cfg.lock_text:
        # a Hugging Face tower's projection is new unless a whole CLIP checkpoint brought it
        text_towers.lock_text_tower(model, new_hf_head=cfg.pretrained is None)
    if cfg.text_hf_model is not None:
        tokenizer = text_towers.hf_tokenizer(cfg.text_hf_model, text_kwargs["text_cfg"]["context_length"])
    else:
        tokenizer = open_clip_tokenizer(cfg.name)
    size = model.visual.image_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    embed_dim = open_clip.get_model_config(cfg.name)["embed_dim"]
    return ModelBundle(model, preprocess_train, preprocess_eval, tokenizer, embed_dim, (3, height, width))


@functools.cache
def open_clip_tokenizer(name: str) -> Callable:
    """open_clip's tokenizer of the architecture ``name``, made once a process: CLIP's BPE tokenizer reads
    and parses its 49k-merge vocabulary each time it is made (~0.2 s of CPU, more than the rest of a toy
    model's Trainer), and it keeps nothing of a call but its memo of words already split."""
    return open_clip.get_tokenizer(name)


def set_grad_checkpointing(model: nn.Module, enable: bool) -> None:
    """Gradient checkpointing on or off in both towers (open_clip's own switch, and off for a Hugging Face
    text tower, whose switch only turns it on)."""
    model.set_grad_checkpointing(enable)
    text_towers.set_text_grad_checkpointing(model, enable)


#: open_clip's 0-dim parameters, which we train with the shape [1]
SCALAR_PARAMETERS = ("logit_scale", "logit_bias")


def add_logit_bias(model: nn.Module, init: float, keep_trained: bool = False) -> None:
    """open_clip's ``logit_bias`` at ``init``: created where the architecture has none (as open_clip's
    ``init_logit_bias`` creates it), a trained one (``keep_trained``: from a checkpoint) left as it is."""
    bias = getattr(model, "logit_bias", None)
    if bias is None:
        model.logit_bias = nn.Parameter(torch.full((), float(init), device=model.logit_scale.device))
    elif not keep_trained:
        with torch.no_grad():
            bias.fill_(init)


def make_logit_scale_1d(model: nn.Module) -> None:
    """Give open_clip's 0-dim logit_scale (and logit_bias) the shape [1]: DeepSpeed 0.19.8 cannot
    broadcast 0-dim params.

    ``export`` reshapes them back, and open_clip's own loader accepts either shape.
    """
    for name in SCALAR_PARAMETERS:
        param = getattr(model, name, None)
        if param is not None and param.ndim == 0:
            setattr(model, name, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))


def to_open_clip_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our training state dict in open_clip's own format (fp32, 0-dim logit_scale and logit_bias)."""
    out = {k: v.detach().float().cpu() for k, v in state_dict.items()}
    for name in SCALAR_PARAMETERS:
        if name in out:
            out[name] = out[name].reshape(())
    return out
