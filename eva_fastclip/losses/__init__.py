"""Contrastive losses, chosen by name in the experiment config (``loss.name``)."""

from eva_fastclip.losses.base import ContrastiveLoss, LossOutput
from eva_fastclip.losses.gather import Gatherer
from eva_fastclip.losses.openclip import OpenClipLoss

#: name -> loss class; every entry takes (config: LossConfig, gatherer: Gatherer, dataset_size: int)
LOSSES: dict[str, type[ContrastiveLoss]] = {
    "openclip": OpenClipLoss,
}


def build_loss(name: str, gatherer: Gatherer, **kwargs) -> ContrastiveLoss:
    try:
        cls = LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}") from None
    return cls(gatherer=gatherer, **kwargs)


__all__ = ["LOSSES", "ContrastiveLoss", "Gatherer", "LossOutput", "OpenClipLoss", "build_loss"]
