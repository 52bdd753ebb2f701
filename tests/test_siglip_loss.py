"""SigLIP's sigmoid loss (eva_fastclip/losses/siglip.py) in float64, one process: against the paper's
formula written out (tests/siglip_reference.py) and open_clip's own ``SigLipLoss``; K simulated ranks and a
cached step against the whole batch; the model's t and b, their optimizer groups, and the config's checks.
Real gloo ranks: tests/launched/test_siglip_two_ranks.py."""

import math

import pytest
import torch
from open_clip.loss import SigLipLoss as OpenClipSigLipLoss
from siglip_reference import B, D, pairs

import eva_fastclip.losses.siglip as siglip_module
from eva_fastclip.config import ConfigError, LossConfig, ModelConfig, OptimConfig, load_config
from eva_fastclip.losses import Gatherer, SigLipLoss, build_loss


def close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def ours_on(leaves, gatherer=None, rows=slice(None)):
    """Our loss on ``rows`` of the batch: its metric and its gradients (features of the rows, log t, b)."""
    images, texts, log_t, b = (x.clone().requires_grad_(True) for x in leaves)
    x, y = images[rows].detach().requires_grad_(True), texts[rows].detach().requires_grad_(True)
    out = SigLipLoss(gatherer)(x, y, log_t.exp(), torch.arange(B)[rows], logit_bias=b)
    return out, torch.autograd.grad(out.loss, (x, y, log_t, b))


@pytest.mark.parametrize("bias", [-10.0, -1.0])
@pytest.mark.parametrize("block", [None, 5])
def test_one_process_equals_the_paper_and_open_clips_siglip_loss(bias, block, monkeypatch):
    """The value and the gradients of the features, log t and b; with rows summed in blocks of 5 logits
    (one row each: the backward recomputes every block) as with one block."""
    if block:
        monkeypatch.setattr(siglip_module, "_BLOCK_ELEMENTS", block)
    leaves, want_loss, want_grads = pairs(seed=1, bias=bias)
    out, grads = ours_on(leaves)
    assert out.metrics["loss/contrastive"] == pytest.approx(want_loss, rel=1e-12)
    assert out.loss.item() == pytest.approx(want_loss, rel=1e-12)  # the columns add gradients, not value
    for got, want in zip(grads, want_grads):
        close(got, want)
    images, texts, log_t, b = (x.clone().requires_grad_(True) for x in leaves)
    theirs = OpenClipSigLipLoss()(images, texts, log_t.exp(), b)
    assert theirs.item() == pytest.approx(want_loss, rel=1e-12)
    for got, want in zip(torch.autograd.grad(theirs, (images, texts, log_t, b)), want_grads):
        close(got, want)
    assert out.metrics["temperature"] == pytest.approx(0.1) and out.metrics["logit_bias"] == bias


class SimulatedRanks(Gatherer):
    """Rank ``rank`` of ``world_size``: an all-gather returns the whole batch the rank's slice came from
    (counted as the real one is)."""

    def __init__(self, rank, world_size, *full):
        super().__init__(rank, world_size)
        self.full = full

    def gather(self, tensor, purpose="gather"):
        self._count(purpose, tensor)
        b = tensor.shape[0]
        (whole,) = [f for f in self.full if torch.equal(f[self.rank * b : (self.rank + 1) * b], tensor)]
        return whole


@pytest.mark.parametrize("world", [2, 3])
def test_the_mean_over_ranks_is_the_whole_batch_gradient_and_no_feature_gradient_is_sent(world):
    """The engine averages the ranks' gradients: rank k's own features get K times their share, t and b
    the mean; the logged values average to the loss; each rank only all-gathers its features."""
    leaves, want_loss, (want_x, want_y, want_t, want_b) = pairs(seed=2, bias=-2.0)
    b = B // world
    mean_t = mean_b = mean_loss = 0.0
    for rank in range(world):
        gatherer = SimulatedRanks(rank, world, leaves[0], leaves[1])
        own = slice(rank * b, (rank + 1) * b)
        out, (gx, gy, gt, gb) = ours_on(leaves, gatherer, own)
        close(gx / world, want_x[own])
        close(gy / world, want_y[own])
        mean_t, mean_b = mean_t + gt / world, mean_b + gb / world
        mean_loss += out.metrics["loss/contrastive"] / world
        assert gatherer.traffic == {"features": 2 * b * D * 8}  # float64 features, forward only
    close(mean_t, want_t)
    close(mean_b, want_b)
    assert mean_loss == pytest.approx(want_loss, rel=1e-12)


def test_a_cached_step_over_micro_batches_is_the_whole_batch():
    """2 ranks x 3 micro-batches of 2 pairs against all 12 (``train.contrastive_batch: global``): the mean
    over ranks and micro-batches of their gradients is the whole batch's."""
    leaves, want_loss, (want_x, want_y, want_t, want_b) = pairs(seed=3, bias=-1.0)
    world, micro = 2, 2
    per_rank = B // world
    mean_t = mean_b = 0.0
    for rank in range(world):
        loss = SigLipLoss(SimulatedRanks(rank, world, leaves[0], leaves[1]))
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        log_t, b = leaves[2].clone().requires_grad_(True), leaves[3].clone().requires_grad_(True)
        loss.begin_cached_step(leaves[0][mine], leaves[1][mine], log_t.exp(), torch.arange(B)[mine], micro)
        for m in range(per_rank // micro):
            rows = slice(rank * per_rank + m * micro, rank * per_rank + (m + 1) * micro)
            x = leaves[0][rows].clone().requires_grad_(True)
            y = leaves[1][rows].clone().requires_grad_(True)
            out = loss.cached_forward(x, y, log_t.exp(), m, logit_bias=b)
            gx, gy = torch.autograd.grad(out.loss, (x, y), retain_graph=True)
            steps = world * per_rank // micro  # the engine's mean over ranks and micro-batches
            close(gx / steps, want_x[rows])
            close(gy / steps, want_y[rows])
            gt, gb = torch.autograd.grad(out.loss, (log_t, b))
            mean_t, mean_b = mean_t + gt / steps, mean_b + gb / steps
        loss.end_cached_step()
    close(mean_t, want_t)
    close(mean_b, want_b)


def test_a_model_without_a_logit_bias_is_refused_by_name():
    leaves, _, _ = pairs()
    with pytest.raises(ValueError, match="logit_bias"):
        SigLipLoss()(leaves[0], leaves[1], leaves[2].exp(), torch.arange(B))


def test_the_model_learns_t_and_b_from_sigLIPs_init_without_weight_decay():
    """loss.name=siglip: open_clip's logit_bias at -10 and t = 10, both [1] (DeepSpeed), both returned by
    the forward, neither decayed (each weight decay rule) and both trained."""
    from eva_fastclip.models import create_model
    from eva_fastclip.optim.param_groups import parameter_groups

    loss_cfg = LossConfig(name="siglip")
    model = create_model(
        ModelConfig(name="test-vit-xs"),
        temperature_init=loss_cfg.temperature_init,
        logit_bias_init=loss_cfg.logit_bias_init,
    ).model
    assert model.logit_scale.shape == model.logit_bias.shape == (1,)
    assert model.logit_scale.item() == pytest.approx(math.log(10)) and model.logit_bias.item() == -10.0
    outputs = model(torch.zeros(2, 3, 32, 32), torch.ones(2, 16, dtype=torch.long))
    assert len(outputs) == 4 and outputs[3] is model.logit_bias
    ids = {id(model.logit_scale): "logit_scale", id(model.logit_bias): "logit_bias"}
    for rule in ("no_embeddings", "fastclip", "eva_clip"):
        groups = parameter_groups(model, OptimConfig(weight_decay=0.1, weight_decay_rule=rule))
        found = {ids[id(p)]: g["weight_decay"] for g in groups for p in g["params"] if id(p) in ids}
        assert found == {"logit_scale": 0.0, "logit_bias": 0.0}, rule


def test_keys_of_another_loss_stop_the_config_by_name():
    with pytest.raises(ConfigError, match=r"^loss\.rho is read only by the compositional losses"):
        LossConfig(name="siglip", rho=6.5)
    with pytest.raises(ConfigError, match=r"^loss\.logit_bias_init is read only by loss\.name=siglip"):
        LossConfig(name="fastclip_v3", logit_bias_init=-10.0)
    with pytest.raises(ConfigError, match="supports temperature_rule fixed or learnable"):
        LossConfig(name="siglip", temperature_rule="rgcl_g")
    # a FastCLIP preset switched to SigLIP names the first of its keys SigLIP does not read
    with pytest.raises(ConfigError, match=r"^loss\.temperature_lr is read only"):
        load_config("configs/cc3m_rn50_fastclip_v3.json", ["loss.name=siglip"])
    # what a saved config holds (every default filled in) loads again
    saved = LossConfig(name="siglip")
    assert LossConfig(**{k: getattr(saved, k) for k in saved.__slots__}) == saved
    assert isinstance(build_loss(saved), SigLipLoss) and not saved.is_compositional


@pytest.mark.parametrize("b, c, d", [(64, 256, 32), (96, 96, 16), (16, 2048, 8)])
def test_tunes_memory_model_counts_the_losses_peak(b, c, d, monkeypatch):
    """tune's loss_buffer_bytes against the peak StorageTracker measures over SigLIP's forward and backward
    (the gathered features made inside, as an all-gather makes them), with row blocks of 1024 logits
    (monkeypatched into both) so that the shapes make one block, and several."""
    from eva_fastclip.tensor_memory import StorageTracker
    from eva_fastclip.tune import memory_model

    assert memory_model.SIGLIP_BLOCK_ELEMENTS == siglip_module._BLOCK_ELEMENTS
    monkeypatch.setattr(siglip_module, "_BLOCK_ELEMENTS", 1024)
    monkeypatch.setattr(memory_model, "SIGLIP_BLOCK_ELEMENTS", 1024)

    class Gathering(Gatherer):
        def gather(self, tensor, purpose="gather"):
            return torch.cat([tensor.detach()] * self.world_size)  # a new [c, d] buffer, as the real one

    x, y = torch.randn(b, d).requires_grad_(True), torch.randn(b, d).requires_grad_(True)
    t, bias = torch.tensor([10.0], requires_grad=True), torch.tensor([-10.0], requires_grad=True)
    loss = SigLipLoss(Gathering(0, c // b))
    tracker = StorageTracker()
    with tracker:
        loss(x, y, t, torch.arange(b), logit_bias=bias).loss.backward()
    assert tracker.peak == pytest.approx(memory_model.loss_buffer_bytes("siglip", b, c, d), rel=0.1)
