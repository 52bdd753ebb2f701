"""Token masking (FLIP patch dropout): switched at run time, and drawn per sample from the sample's key.

open_clip's own towers drop patches with ``open_clip.transformer.PatchDropout``, timm's EVA trunks with
``PatchDropoutWithIndices`` (which also drops the matching RoPE rows) and timm's ViT trunks with timm's
``PatchDropout``; all read their ``prob`` attribute on every call and do nothing in eval mode, so changing
``prob`` is all it takes to switch masking.

All draw their mask from the process's global generator, so a sample's mask depends on the rank, the
micro-batch and every draw before it. :func:`key_patch_dropout` gives the modules of a model a keyed draw
instead: inside :func:`keyed_masks` (the trainer's forward and backward) the kept tokens of sample i are a
function of ``keys[i]`` alone, the sample's key from the loader (``data/sample_keys.py``: run seed, epoch,
sample, occurrence). So the no-grad and the grad pass of a cached step see the same mask, and 1 or K ranks
and a resumed run mask every sample alike. The distribution is the modules' own: each draw keeps a
uniformly random subset of ``max(1, int(L·(1−prob)))`` of the L patch tokens (open_clip and timm take the
top of i.i.d. noise, as we do, from a counter-based hash of (key, token) instead of the generator).
Outside :func:`keyed_masks` the modules draw as they always did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from open_clip.transformer import PatchDropout
from timm.layers.patch_dropout import PatchDropout as TimmPatchDropout
from timm.layers.patch_dropout import PatchDropoutWithIndices
from torch import nn

_MASK32 = 0xFFFFFFFF


def patch_dropout_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that drop patch tokens in ``model`` (open_clip's and timm's, keyed or not)."""
    return [
        m for m in model.modules() if isinstance(m, (PatchDropout, TimmPatchDropout, PatchDropoutWithIndices))
    ]


def set_patch_dropout(model: nn.Module, prob: float) -> int:
    """Set the fraction of patch tokens dropped in training; returns how many modules changed."""
    if not 0.0 <= prob < 1.0:
        raise ValueError(f"patch dropout must be in [0, 1), got {prob}")
    modules = patch_dropout_modules(model)
    for module in modules:
        module.prob = prob
    return len(modules)


# ---- keyed draws ----------------------------------------------------------------------------------------


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x · constant) mod 2^32 for x in [0, 2^32), in int64 without overflow (16-bit halves)."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser: every input bit flips each output bit with probability about 1/2."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def token_noise(keys: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[B, num_tokens] int64 in [0, 2^32): a hash of (keys[b], token), independent across tokens."""
    keys = keys.to(torch.int64).reshape(-1, 1) & _MASK32
    tokens = torch.arange(num_tokens, device=keys.device, dtype=torch.int64).reshape(1, -1)
    return _fmix32(_fmix32(keys) ^ _mul32(tokens + 1, 0x9E3779B9))


def keep_indices(keys: torch.Tensor, num_tokens: int, prob: float) -> torch.Tensor:
    """The kept tokens of each sample, [B, max(1, int(L·(1−prob)))]: the largest of its noise."""
    num_keep = max(1, int(num_tokens * (1.0 - prob)))
    return token_noise(keys, num_tokens).topk(num_keep, dim=-1).indices


class KeyedPatchDropout(PatchDropout):
    """open_clip's PatchDropout, its mask drawn from ``sample_keys`` when they are set."""

    sample_keys: torch.Tensor | None = None

    def forward(self, x):
        if not self.training or self.prob == 0.0 or self.sample_keys is None:
            return super().forward(x)
        prefix = 1 if self.exclude_first_token else 0
        keep = keep_indices(self.sample_keys.to(x.device), x.shape[1] - prefix, self.prob) + prefix
        kept = x.gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return torch.cat((x[:, :1], kept), dim=1) if prefix else kept


def _keep_after_prefix(x: torch.Tensor, keys: torch.Tensor, prefix: int, prob: float, ordered: bool):
    """timm's drop: the ``prefix`` tokens kept, of the others those ``keys`` pick; (x, kept indices)."""
    keep = keep_indices(keys.to(x.device), x.shape[1] - prefix, prob)
    if ordered:
        keep = keep.sort(dim=-1).values
    kept = x[:, prefix:].gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return (torch.cat((x[:, :prefix], kept), dim=1) if prefix else kept), keep


class KeyedPatchDropoutWithIndices(PatchDropoutWithIndices):
    """timm's PatchDropoutWithIndices (EVA trunks), its mask drawn from ``sample_keys`` when set."""

    sample_keys: torch.Tensor | None = None

    def forward(self, x):
        if not self.training or self.prob == 0.0 or self.sample_keys is None:
            return super().forward(x)
        return _keep_after_prefix(x, self.sample_keys, self.num_prefix_tokens, self.prob, self.ordered)


class KeyedTimmPatchDropout(TimmPatchDropout):
    """timm's PatchDropout (ViT trunks), its mask drawn from ``sample_keys`` when set."""

    sample_keys: torch.Tensor | None = None

    def forward(self, x):
        if not self.training or self.prob == 0.0 or self.sample_keys is None:
            return super().forward(x)
        return _keep_after_prefix(x, self.sample_keys, self.num_prefix_tokens, self.prob, self.ordered)[0]


_KEYED = {
    PatchDropout: KeyedPatchDropout,
    PatchDropoutWithIndices: KeyedPatchDropoutWithIndices,
    TimmPatchDropout: KeyedTimmPatchDropout,
}


def key_patch_dropout(model: nn.Module) -> int:
    """Give every patch dropout module of ``model`` the keyed draw (in place: the modules keep their
    settings and hold no parameters); returns how many."""
    modules = patch_dropout_modules(model)
    for module in modules:
        module.__class__ = _KEYED.get(type(module), type(module))
    return len(modules)


@contextlib.contextmanager
def keyed_masks(model: nn.Module, keys: torch.Tensor) -> Iterator[None]:
    """Within the block, sample i of a forward pass through ``model`` keeps the tokens ``keys[i]`` picks
    (keep it open over the backward too: a checkpointed forward is run again there)."""
    modules = [m for m in patch_dropout_modules(model) if hasattr(m, "sample_keys")]
    for module in modules:
        module.sample_keys = keys
    try:
        yield
    finally:
        for module in modules:
            module.sample_keys = None
