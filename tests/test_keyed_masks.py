"""Token masks keyed by the sample (models/masking.py): a sample's kept tokens depend on its key alone, never
on its batch, its place in it or the generator's state, so both passes of a cached step and 1 or K ranks
mask it alike; the draw keeps open_clip's distribution (a uniformly random subset of a fixed size)."""

import itertools
import math

import pytest
import torch

from eva_fastclip.config import ModelConfig
from eva_fastclip.data.sample_keys import keys_for_indices, sample_key
from eva_fastclip.models import create_model
from eva_fastclip.models.masking import (
    KeyedPatchDropout,
    KeyedPatchDropoutWithIndices,
    keep_indices,
    keyed_masks,
    patch_dropout_modules,
)


@pytest.fixture(scope="module", params=["test-vit-xs", "test-eva02-xs"])
def model(request):
    """open_clip's own ViT (PatchDropout) and a timm EVA trunk (PatchDropoutWithIndices, RoPE)."""
    torch.manual_seed(0)
    bundle = create_model(ModelConfig(name=request.param, patch_dropout=0.5))
    assert {type(m) for m in patch_dropout_modules(bundle.model)} <= {
        KeyedPatchDropout,
        KeyedPatchDropoutWithIndices,
    }
    return bundle.model.train()


def encode(model, images, keys):
    with keyed_masks(model, keys), torch.no_grad():
        return model.encode_image(images)


def test_a_samples_features_depend_on_its_key_not_its_batch(model):
    """Sample 0's features with its key are the same alone, in a batch of 4 at another place, and after
    the global generator drew; another key masks other tokens (other features)."""
    g = torch.Generator().manual_seed(1)
    images = torch.randn(4, 3, 32, 32, generator=g)
    keys = keys_for_indices(seed=0, epoch=0, indices=torch.tensor([7, 3, 5, 1]))
    alone = encode(model, images[:1], keys[:1])
    torch.randn(100)  # the global generator moves on: the keyed draw does not read it
    in_batch = encode(model, images[[2, 1, 0, 3]], keys[[2, 1, 0, 3]])
    torch.testing.assert_close(in_batch[2:3], alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())
    other = encode(model, images[:1], keys[1:2])
    assert (other - alone).norm() > 0.05 * alone.norm()


def test_outside_keyed_masks_the_modules_draw_as_before(model):
    """No keys: open_clip's / timm's own draw from the global generator (seeded, the same twice)."""
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.manual_seed(5)
        a = model.encode_image(images)
        torch.manual_seed(5)
        b = model.encode_image(images)
        c = model.encode_image(images)
    assert torch.equal(a, b) and (a - c).norm() > 0.05 * a.norm()


def test_evaluation_keeps_every_token(model):
    images, keys = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    model.eval()
    try:
        with torch.no_grad():
            plain = model.encode_image(images)
        torch.testing.assert_close(encode(model, images, keys), plain)
    finally:
        model.train()


def test_the_kept_tokens_are_a_uniformly_random_subset_of_open_clips_size():
    """Over 20,000 keys: each of the C(6, 3) = 20 subsets of 3 of 6 tokens is drawn about 1,000 times
    (chi-square with 19 degrees of freedom, below its 99.99% quantile 50.8), and with 196 tokens at 50%
    each token is kept about half the time; the size is open_clip's max(1, int(L·(1 − p)))."""
    keys = torch.arange(20_000) * 7919 + 13
    kept = keep_indices(keys, 6, 0.5).sort(dim=1).values
    counts = {subset: 0 for subset in itertools.combinations(range(6), 3)}
    for row in kept.tolist():
        counts[tuple(row)] += 1
    expected = len(keys) / len(counts)
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 50.8, counts
    keep = keep_indices(keys, 196, 0.5)
    assert keep.shape == (len(keys), 98) and all(len(set(r)) == 98 for r in keep[:100].tolist())
    frequency = torch.zeros(196).scatter_add_(0, keep.flatten(), torch.ones(keep.numel())) / len(keys)
    assert (frequency - 0.5).abs().max() < 4.5 * math.sqrt(0.25 / len(keys))
    assert keep_indices(keys[:3], 5, 0.9).shape == (3, 1)  # never zero tokens


def test_keys_follow_the_seed_the_epoch_and_the_sample():
    base = sample_key(0, 0, 17)
    assert (
        len({base, sample_key(1, 0, 17), sample_key(0, 1, 17), sample_key(0, 0, 18), sample_key(0, 0, 17, 1)})
        == 5
    )
    assert keys_for_indices(0, 0, torch.tensor([17, 18])).tolist() == [base, sample_key(0, 0, 18)]


def test_every_kind_of_patch_dropout_is_keyed():
    """open_clip's, timm's PatchDropout (its ViT trunks) and PatchDropoutWithIndices (EVA): each found,
    keyed in place, and its kept tokens (the prefix token first) those of ``keep_indices``."""
    from open_clip.transformer import PatchDropout
    from timm.layers.patch_dropout import PatchDropout as TimmPatchDropout
    from timm.layers.patch_dropout import PatchDropoutWithIndices
    from torch import nn

    from eva_fastclip.models.masking import key_patch_dropout, set_patch_dropout

    model = nn.Sequential(PatchDropout(0.5), TimmPatchDropout(0.5), PatchDropoutWithIndices(0.5)).train()
    assert key_patch_dropout(model) == 3 and set_patch_dropout(model, 0.25) == 3
    x = torch.arange(2 * 9, dtype=torch.float32).reshape(2, 9, 1)  # token t of sample b holds 9b + t
    keys = torch.tensor([11, 12])
    want = keep_indices(keys, 8, 0.25) + 1  # after the class token
    with keyed_masks(model, keys):
        outputs = [model[0](x), model[1](x), model[2](x)[0]]
    for out in outputs:
        assert out.shape == (2, 7, 1) and torch.equal(out[:, 0, 0], x[:, 0, 0])
        assert torch.equal(
            out[:, 1:, 0].sort().values, (want + torch.tensor([[0], [9]])).sort().values.float()
        )
