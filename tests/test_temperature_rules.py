"""FastCLIP-v2's per-sample temperature update against the rule FastCLIP's code implements
(fastclip_reference.py), and the validation of loss.tau_gradient."""

import pytest
import torch
from fastclip_reference import IndividualTau

from eva_fastclip.config import ConfigError, LossConfig
from eva_fastclip.temperature import TemperatureController


def test_individual_adam_follows_fastclip_v2_code():
    """Epochs 0, 0, 1, 1, 2, 5: betas 0 in epoch 0, bias correction by epoch + 1, sqrt(v_hat), gradient
    clamp ±5 and tau in [0.01, 1], each step equal to FastCLIP's (float64, several samples at once)."""
    cfg = LossConfig(name="fastclip_v2")  # lr 0.0133, betas (0.9, 0.999): FastCLIP's CC3M RN50 run
    controller = TemperatureController.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    tau = torch.full((16,), 0.03, dtype=torch.float64)
    tau[:4] = 0.0105  # a few near the lower bound, so the clamp acts
    reference = IndividualTau(tau, lr_tau=cfg.temperature_lr)
    m, v = torch.zeros_like(tau), torch.zeros_like(tau)
    for epoch in (0, 0, 1, 1, 2, 5):
        grad = 4 * torch.randn(16, generator=g, dtype=torch.float64)  # some beyond the clamp
        grad[:4] = grad[:4].abs() + 1  # ...and push those near the bound below it
        tau, m, v = controller.individual_step(tau, grad, m, v, epoch)
        reference.set_epoch(epoch)
        reference.step(grad)
        torch.testing.assert_close(tau, reference.tau, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(m, reference.m, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(v, reference.v, rtol=1e-12, atol=1e-15)
    assert (tau[:4] == 0.01).all() and (tau[4:] > 0.01).all()


def test_tau_gradient_is_validated():
    assert LossConfig(name="fastclip_v3").tau_gradient == "exact"
    assert LossConfig(name="fastclip_v3", tau_gradient="fastclip_code").tau_gradient == "fastclip_code"
    with pytest.raises(ConfigError, match="loss.tau_gradient must be one of"):
        LossConfig(name="fastclip_v3", tau_gradient="twice")
    for name in ("fastclip_v0", "fastclip_v2", "openclip"):
        with pytest.raises(ConfigError, match="loss.tau_gradient=fastclip_code applies only to"):
            LossConfig(name=name, tau_gradient="fastclip_code")
