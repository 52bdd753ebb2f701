"""eva_fastclip: CLIP training on tens of GPUs with compositional contrastive losses and EVA towers."""

__version__ = "0.1.0"
