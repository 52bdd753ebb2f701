"""The OpenCLIP baseline against OpenCLIP's own ClipLoss and a float64 formula written out here."""

import math

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss

from eva_fastclip.config import LossConfig
from eva_fastclip.losses import Gatherer, OpenClipLoss
from eva_fastclip.optim.temperature import TemperatureController


def features(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1),
        F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1),
    )


def reference_infonce(images, texts, scale):
    """Symmetric InfoNCE over the whole batch: mean_i of -log softmax along rows and along columns."""
    logits = scale * images @ texts.T
    n = logits.shape[0]
    rows = -torch.stack([logits[i, i] - torch.logsumexp(logits[i], 0) for i in range(n)]).mean()
    cols = -torch.stack([logits[i, i] - torch.logsumexp(logits[:, i], 0) for i in range(n)]).mean()
    return 0.5 * (rows + cols)


def test_single_process_matches_open_clip_and_reference():
    images, texts = features(12, 8, seed=0)
    scale = torch.tensor([1 / 0.07], dtype=torch.float64)  # open_clip's forward returns exp(logit_scale)
    ours = OpenClipLoss()(images, texts, scale, torch.arange(12)).loss
    theirs = ClipLoss()(images, texts, scale)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    assert ours.item() == pytest.approx(reference_infonce(images, texts, scale).item(), rel=1e-12)


class SimulatedRanks(Gatherer):
    """Plays rank `rank` of `world_size`: 'gathering' returns the whole batch that the slice came from."""

    def __init__(self, rank, world_size, full_images, full_texts):
        super().__init__(rank, world_size)
        self.full = (full_images, full_texts)

    def gather_with_grad(self, tensor):
        b = tensor.shape[0]
        for full in self.full:
            if torch.equal(full[self.rank * b : (self.rank + 1) * b], tensor):
                return full
        raise AssertionError("not a local slice of the batch")


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_average_to_the_full_batch_gradient(world_size):
    """Each rank scores its own rows; averaging the ranks' gradients (what the engine's all-reduce does)
    must give the gradient of the full-batch loss, for the features and the temperature."""
    images, texts = features(16, 8, seed=1)
    images.requires_grad_(True)
    texts.requires_grad_(True)
    log_scale = torch.tensor([2.5], dtype=torch.float64, requires_grad=True)  # the learnable log(1/tau)
    full = reference_infonce(images, texts, log_scale.exp())
    expected = torch.autograd.grad(full, (images, texts, log_scale))

    b = 16 // world_size
    total = 0
    for rank in range(world_size):
        loss = OpenClipLoss(SimulatedRanks(rank, world_size, images, texts))
        sl = slice(rank * b, (rank + 1) * b)
        total = total + loss(images[sl], texts[sl], log_scale.exp(), torch.arange(16)[sl]).loss / world_size
    got = torch.autograd.grad(total, (images, texts, log_scale))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)


def test_reports_temperature():
    images, texts = features(4, 8, seed=2)
    out = OpenClipLoss()(images, texts, torch.tensor([20.0]), torch.arange(4))
    assert out.metrics["temperature"] == pytest.approx(0.05)
    # OpenCLIP keeps log(1/tau) in [0, ln 100]: the controller's default bounds tau in [0.01, 1]
    controller = TemperatureController.from_config(LossConfig(name="openclip"))
    assert controller.learns_global
    assert controller.logit_scale_bounds() == (0.0, pytest.approx(math.log(100)))
