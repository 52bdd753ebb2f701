"""Contrastive losses, chosen by name in the experiment config (``loss.name``).

Each works outside the trainer too, in one process::

    loss_fn = build_loss("fastclip_v3", dataset_size=10_000)
    out = loss_fn(image_features, text_features, logit_scale, indices)   # open_clip's outputs
    out.loss.backward(); loss_fn.on_step_applied()                        # commit the per-sample state
    loss_fn.state.local_rows(indices)                                     # log u1, log u2, ... per sample
"""

from __future__ import annotations

from eva_fastclip.config import LOSS_DEFAULTS, LossConfig
from eva_fastclip.losses.base import ContrastiveLoss, LossOutput
from eva_fastclip.losses.compositional import CompositionalLoss
from eva_fastclip.losses.gather import Gatherer
from eva_fastclip.losses.openclip import OpenClipLoss
from eva_fastclip.losses.siglip import SigLipLoss
from eva_fastclip.losses.state import PerSampleTable

#: every loss name the config accepts -> its class
LOSSES: dict[str, type[ContrastiveLoss]] = {
    name: {"openclip": OpenClipLoss, "siglip": SigLipLoss}.get(name, CompositionalLoss)
    for name in LOSS_DEFAULTS
}


def build_loss(
    cfg: LossConfig | str,
    *,
    gatherer: Gatherer | None = None,
    dataset_size: int | None = None,
    temperature=None,
    **overrides,
) -> ContrastiveLoss:
    """The loss of ``cfg`` (a LossConfig, or a name plus LossConfig keys as keyword overrides).

    A cosine gamma schedule needs ``gamma_decay_epochs`` (FastCLIP: half the run's epochs; the trainer
    derives it from the run's length): without it the loss trains its first epoch (gamma = 1) and stops
    with a ValueError when the second begins."""
    if isinstance(cfg, str):
        cfg = LossConfig(name=cfg, **overrides)
    if not cfg.is_compositional:  # the mini-batch losses: no per-sample state, no options of their own
        return LOSSES[cfg.name](gatherer)
    if dataset_size is None:
        raise ValueError(f"loss {cfg.name!r} keeps per-sample state: pass dataset_size")
    return CompositionalLoss(cfg, dataset_size=dataset_size, gatherer=gatherer, temperature=temperature)


__all__ = [
    "LOSSES",
    "CompositionalLoss",
    "ContrastiveLoss",
    "Gatherer",
    "LossOutput",
    "OpenClipLoss",
    "PerSampleTable",
    "SigLipLoss",
    "build_loss",
]
