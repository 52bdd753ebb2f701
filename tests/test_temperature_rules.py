"""FastCLIP-v2's per-sample temperature update against the rule FastCLIP's code implements
(fastclip_reference.py), rgcl_g's temperature-lr drop against FastCLIP's scheduler, and the defaults and
validation of the temperature options."""

import json
import math

import pytest
import torch
from fastclip_reference import IndividualTau
from stand_ins import StandInBatches, toy_config, toy_trainer

from eva_fastclip.config import ConfigError, LossConfig
from eva_fastclip.optim.temperature import TemperatureController


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
    # the default is what FastCLIP's published v3 runs used; the exact gradient is an option
    assert LossConfig(name="fastclip_v3").tau_gradient == "fastclip_code"
    assert LossConfig(name="fastclip_v3", tau_gradient="exact").tau_gradient == "exact"
    for name in ("fastclip_v0", "fastclip_v2", "isogclr", "openclip"):
        assert LossConfig(name=name).tau_gradient == "exact"
    assert LossConfig(name="fastclip_v3", temperature_rule="fixed").tau_gradient == "exact"
    with pytest.raises(ConfigError, match="loss.tau_gradient must be one of"):
        LossConfig(name="fastclip_v3", tau_gradient="twice")
    for name in ("fastclip_v0", "fastclip_v2", "openclip"):
        with pytest.raises(ConfigError, match="loss.tau_gradient=fastclip_code applies only to"):
            LossConfig(name=name, tau_gradient="fastclip_code")


# ---- rgcl_g's temperature-lr drop -----------------------------------------------------------------------


def fastclip_step_thresh(base_lr: float, tau: float) -> float:
    """FastCLIP's scheduler.py:80-92 (HEAD efd89d5) as main.py:438 calls it (thresholds [0.03], ratios
    [1/3], no warm-up), before every step from the model's current tau."""
    lr = base_lr
    for thresh, ratio in zip([0.03], [1 / 3]):
        if tau <= thresh:
            lr = base_lr * ratio
        else:
            break
    return lr


def drive(controller: TemperatureController, taus: list[float]) -> list[float]:
    """The temperature group's lr for the step after each tau (the first before any step)."""
    lr = [controller.own_group_lr]

    def set_group_lr(value: float) -> None:
        lr[0] = value

    lrs = []
    for tau in taus:
        controller.after_applied_step(math.log(1 / tau), lambda theta: None, set_group_lr)
        lrs.append(lr[0])
    return lrs


# down through the threshold, back above it, down again; starting above and starting below it
TAUS = [0.07, 0.045, 0.0301, 0.03, 0.0299, 0.026, 0.0305, 0.04, 0.029, 0.02, 0.035]


@pytest.mark.parametrize("taus", [TAUS, [0.025, *TAUS]])
def test_rgcl_g_lr_follows_fastclip_scheduler_every_step(taus):
    controller = TemperatureController.from_config(LossConfig(name="fastclip_v3", temperature_lr=2e-4))
    assert controller.lr_drop_rule == "every_step"  # the default: FastCLIP's
    got = drive(controller, taus)
    want = [fastclip_step_thresh(2e-4, tau) for tau in taus]
    assert got == pytest.approx(want, rel=1e-15)
    assert len(set(got)) == 2 and got[-1] == 2e-4  # it did go down and back up


def test_rgcl_g_lr_drop_once_stays_down():
    cfg = LossConfig(name="fastclip_v3", temperature_lr=2e-4, temperature_lr_drop_rule="once")
    got = drive(TemperatureController.from_config(cfg), TAUS)
    first = next(i for i, tau in enumerate(TAUS) if tau <= 0.03)
    want = [2e-4 if i < first else 2e-4 / 3 for i in range(len(TAUS))]
    assert got == pytest.approx(want, rel=1e-15)
    with pytest.raises(ConfigError, match="loss.temperature_lr_drop_rule must be one of"):
        LossConfig(name="fastclip_v3", temperature_lr_drop_rule="twice")


def test_a_resumed_drop_state_is_kept_and_rechecked():
    """The saved state says whether the lr was dropped at the save (the trainer puts that lr back); the
    first check after it changes the lr only if tau says so, and a removed threshold raises it again."""
    saved = TemperatureController.from_config(LossConfig(name="fastclip_v3"))
    drive(saved, [0.02])
    resumed = TemperatureController.from_config(LossConfig(name="fastclip_v3"))
    resumed.load_state_dict(saved.state_dict())
    calls = []
    resumed.after_applied_step(math.log(1 / 0.02), lambda theta: None, calls.append)
    assert resumed.lr_dropped and calls == []  # unchanged: no call
    resumed.lr_drop_below = None
    resumed.after_applied_step(math.log(1 / 0.02), lambda theta: None, calls.append)
    assert not resumed.lr_dropped and calls == [resumed.lr]


@pytest.mark.parametrize("tau_init", [0.025, 0.0301])
def test_the_trainer_sets_the_temperature_lr_from_tau_before_every_step(tmp_path, tau_init):
    """One rank, in this process: the first step trains at the lr tau_init gives (dropped below 0.03), and
    after every step the lr of the next one is FastCLIP's rule applied to the tau it starts from (the next
    record's temperature)."""
    cfg = toy_config(
        tmp_path,
        "loss.name=fastclip_v3",
        f"loss.temperature_init={tau_init}",
        "loss.temperature_lr=0.01",  # big steps: tau moves by about 1% a step around the threshold
        "train.batch_size=8",
        "train.steps=8",
        "optim.warmup_steps=1",
    )
    trainer = toy_trainer(cfg, loader=StandInBatches(4, 8, dataset_size=32, indices="chunks"))
    (group,) = [g for g in trainer.engine.optimizer.param_groups if g["name"] == "temperature"]
    assert group["lr"] == pytest.approx(fastclip_step_thresh(0.01, tau_init), rel=1e-12)
    trainer.train()
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 9))
    assert log[0]["temperature"] == pytest.approx(tau_init, rel=1e-6)
    for record, following in zip(log, log[1:]):
        want = fastclip_step_thresh(0.01, following["temperature"])
        assert record["lr/temperature"] == pytest.approx(want, rel=1e-12), (record, following)


def test_isogclr_defaults_are_fastclip_code_s():
    """iSogCLR as FastCLIP's code runs it: v2's Adam-like rule and values, a constant gamma; its own
    momentum rule is an option with its own lr."""
    cfg = LossConfig(name="isogclr")
    v2 = LossConfig(name="fastclip_v2")
    assert cfg.temperature_rule == "individual_adam" == v2.temperature_rule
    for key in ("temperature_init", "temperature_lr", "rho", "temperature_betas", "temperature_grad_clip"):
        assert getattr(cfg, key) == getattr(v2, key), key
    assert (cfg.gamma_schedule, v2.gamma_schedule) == ("constant", "cosine")
    momentum = LossConfig(name="isogclr", temperature_rule="individual_momentum")
    assert momentum.temperature_lr == 0.03
    explicit = LossConfig(name="isogclr", temperature_rule="individual_momentum", temperature_lr=0.1)
    assert explicit.temperature_lr == 0.1
