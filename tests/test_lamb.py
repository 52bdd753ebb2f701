"""The CPU LAMB against DeepSpeed's FusedLamb kernel, rewritten below in float64 from
csrc/lamb/fused_lamb_cuda_kernel.cu: single tensors, several steps, the trust ratio at both clipping bounds,
the temperature switch on both devices, and a real ZeRO-1 engine step on its flat partitions."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from eva_fastclip.config import OptimConfig, load_config
from eva_fastclip.engine.lamb import Lamb
from eva_fastclip.engine.setup import build_optimizer, build_scheduler

LAMB_JSON = Path(__file__).parents[1] / "ds_configs" / "zero1_fp32_lamb.json"
BETAS, EPS = (0.9, 0.98), 1e-6


def kernel_step(w, g, m, v, step, *, lr, weight_decay, betas=BETAS, eps=EPS, max_coeff=10.0, min_coeff=0.01,
                bias_correction=True, eps_inside_sqrt=False):  # fmt: skip
    """One FusedLamb update of one tensor in float64: lamb_cuda_kernel_part1..3 and fused_lamb_cuda.

    part1: m, v from the gradient; u = m / denom + decay * w; sums of w^2 and u^2 (w before the update).
    part3: lamb_coeff = ||w|| / ||u|| clipped (max first, then min), 1 when either norm is 0;
    w -= step_size * lamb_coeff * u, step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t) with bias correction.
    Returns (w, m, v, lamb_coeff).
    """
    w, g, m, v = (x.detach().double() for x in (w, g, m, v))
    beta1, beta2 = betas
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = torch.sqrt(v + eps) if eps_inside_sqrt else torch.sqrt(v) + eps
    u = m / denom + weight_decay * w
    reg_w, reg_u = math.sqrt((w * w).sum().item()), math.sqrt((u * u).sum().item())
    coeff = 1.0
    if reg_w != 0 and reg_u != 0:
        coeff = reg_w / reg_u
        if coeff > max_coeff:
            coeff = max_coeff
        if coeff < min_coeff:
            coeff = min_coeff
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step) if bias_correction else lr
    return w - step_size * coeff * u, m, v, coeff


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.detach().double(), expected, rtol=2e-6, atol=1e-7)


def _tensors():
    """(name, value, group settings): one of each case the kernel treats differently."""
    g = torch.Generator().manual_seed(0)
    return [
        ("matrix", torch.randn(16, 8, generator=g), {"weight_decay": 0.1}),  # ratio inside the bounds
        ("bias", torch.randn(8, generator=g) * 0.1, {"weight_decay": 0.0}),  # no decay: ratio all the same
        ("zero", torch.zeros(5), {"weight_decay": 0.0}),  # ||w|| = 0: ratio 1
        ("big", torch.full((6, 4), 1e3), {"weight_decay": 0.0}),  # ratio far above max_coeff
        ("tiny", torch.randn(7, generator=g) * 1e-6, {"weight_decay": 0.0}),  # far below min_coeff
        ("theta", torch.tensor([2.66]), {"weight_decay": 0.0, "max_coeff": 1.0, "min_coeff": 1.0}),
    ]


@pytest.mark.parametrize(
    "options",
    [{}, {"bias_correction": False}, {"eps_inside_sqrt": True}, {"eps": 1e-2}],
    ids=["default", "no-bias-correction", "eps-inside-sqrt", "large-eps"],
)
def test_steps_match_the_kernel(options):
    cases = _tensors()
    params = [nn.Parameter(value.clone()) for _, value, _ in cases]
    lr = 1e-2
    optimizer = Lamb(
        [{"params": [p], **settings} for p, (_, _, settings) in zip(params, cases)],
        lr=lr,
        betas=BETAS,
        **{"eps": EPS, **options},
    )
    kernel_options = {"eps": EPS, **options}
    expected = [
        (p.detach().double(), torch.zeros_like(p.double()), torch.zeros_like(p.double())) for p in params
    ]
    steps = [0] * len(params)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        skipped = 1 if step == 2 else None  # a tensor without a gradient is not stepped, nor counted
        for i, (p, grad) in enumerate(zip(params, grads)):
            p.grad = None if i == skipped else grad.clone()
        optimizer.step()
        if step == 1:
            first = dict(zip([name for name, _, _ in cases], optimizer.get_lamb_coeffs()))
        coeffs = iter(optimizer.get_lamb_coeffs())
        for i, ((name, _, settings), p, grad) in enumerate(zip(cases, params, grads)):
            if i == skipped:
                continue
            steps[i] += 1
            w, m, v = expected[i]
            w, m, v, coeff = kernel_step(w, grad, m, v, steps[i], lr=lr, **settings, **kernel_options)
            expected[i] = (w, m, v)
            assert next(coeffs) == pytest.approx(coeff, rel=1e-5), (name, step)
            assert_matches(p, w)
            assert_matches(optimizer.state[p]["exp_avg"], m)
            assert_matches(optimizer.state[p]["exp_avg_sq"], v)
            assert optimizer.state[p]["step"] == steps[i]
        assert next(coeffs, None) is None
    # every case did what it is there for
    assert first["zero"] == 1.0 and first["big"] == 10.0 and first["tiny"] == 0.01 and first["theta"] == 1.0
    assert 0.01 < first["matrix"] < 10.0 and 0.01 < first["bias"] < 10.0


def test_every_tensor_gets_the_trust_ratio_unlike_timm():
    """The difference this optimizer exists for: a no-decay tensor is scaled by ||w|| / ||u|| too."""
    from timm.optim import Lamb as TimmLamb

    start = torch.full((4,), 3.0)
    grad = torch.tensor([1.0, -2.0, 0.5, 3.0])
    moved = {}
    for name, cls, kwargs in [("ours", Lamb, {}), ("timm", TimmLamb, {"max_grad_norm": None})]:
        p = nn.Parameter(start.clone())
        optimizer = cls([{"params": [p], "weight_decay": 0.0}], lr=1e-2, betas=BETAS, eps=EPS, **kwargs)
        p.grad = grad.clone()
        optimizer.step()
        moved[name] = (p.detach() - start).norm().item()
    # step 1: ||step|| = lr * ratio * ||u|| * sqrt(1 - b2) / (1 - b1) = lr * ||w|| * 1.414 (bias correction)
    assert moved["ours"] == pytest.approx(1e-2 * 6.0 * math.sqrt(1 - BETAS[1]) / (1 - BETAS[0]), rel=1e-5)
    assert moved["timm"] == pytest.approx(1e-2 * 2.0, rel=1e-4)  # Adam's unit step per element


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_grad_norm": 1.0}, "gradient_clipping"),
        ({"amsgrad": True}, "AMSGrad"),
        ({"min_coeff": 20.0}, "min_coeff <= max_coeff"),
        ({"betas": (0.9, 1.0)}, r"betas must lie in \[0, 1\)"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Lamb([nn.Parameter(torch.ones(2))], **kwargs)


def test_state_from_an_unknown_optimizer_is_refused():
    p = nn.Parameter(torch.ones(3))
    optimizer = Lamb([p])
    optimizer.state[p].update(exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3))  # no step anywhere
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="no per-tensor 'step'"):
        optimizer.step()


def test_a_checkpoint_of_timms_lamb_continues():
    """Checkpoints from before this class hold timm's Lamb state (step per group, max_grad_norm None):
    they continue with timm's moments and step count, and the next step is the kernel's."""
    from timm.optim import Lamb as TimmLamb

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 3))
    old = TimmLamb([{"params": [w], "weight_decay": 0.1}], lr=1e-3, betas=BETAS, eps=EPS, max_grad_norm=None)
    for _ in range(3):
        w.grad = torch.randn(4, 3)
        old.step()
    saved = old.state_dict()
    m, v = (saved["state"][0][key].clone() for key in ("exp_avg", "exp_avg_sq"))

    ours = Lamb([{"params": [w], "weight_decay": 0.1}], lr=1e-3, betas=BETAS, eps=EPS)
    ours.load_state_dict(saved)
    assert ours.param_groups[0]["max_grad_norm"] == 0.0 and "always_adapt" not in ours.param_groups[0]
    grad = torch.randn(4, 3)
    expected, *_ = kernel_step(w, grad, m, v, 4, lr=1e-3, weight_decay=0.1)
    w.grad = grad
    ours.step()
    assert ours.state[w]["step"] == 4
    assert_matches(w, expected)


# ---- the temperature switch on both devices -------------------------------------------------------------


class TinyClip(nn.Module):
    """Parameters of neither tower: a decayed matrix, no-decay vectors (one all zero), the temperature."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.proj = nn.Linear(6, 4)
        self.norm = nn.LayerNorm(4)  # bias all zero: ||w|| = 0
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(4, 6, generator=g))
            self.proj.bias.copy_(torch.randn(4, generator=g))
        self.logit_scale = nn.Parameter(torch.tensor([math.log(1 / 0.07)]))
        self.register_buffer("readout", torch.tensor([1.0, -2.0, 0.5, 3.0]))  # a plain sum of a norm is 0

    def forward(self, x):
        return (self.norm(self.proj(x)) * self.readout).sum(-1) * self.logit_scale.exp()


def _resolved_ds(**lamb_params):
    ds = json.loads(LAMB_JSON.read_text())
    ds["optimizer"]["params"].update(lr=1e-3, weight_decay=0.1, **lamb_params)
    ds["gradient_clipping"] = 0.0
    return ds


def fake_fused_lamb_kernel(p, out_p, m, v, g, lr, beta1, beta2, max_coeff, min_coeff, eps, grad_scale, step,
                           mode, bias_correction, decay):  # fmt: skip
    """fused_lamb_cuda.lamb's contract on CPU (the float64 rewrite above), so FusedLamb's own Python side,
    which reads each group's settings, runs without CUDA."""
    w, m_new, v_new, coeff = kernel_step(p, g / grad_scale, m, v, step, lr=lr, weight_decay=decay,
                                         betas=(beta1, beta2), eps=eps, max_coeff=max_coeff,
                                         min_coeff=min_coeff, bias_correction=bool(bias_correction),
                                         eps_inside_sqrt=mode == 0)  # fmt: skip
    for dst, src in ((p, w), (m, m_new), (v, v_new)):
        dst.copy_(src)
    return torch.tensor([coeff])


@pytest.fixture
def fused_lamb_on_cpu(monkeypatch):
    import deepspeed.ops.lamb.fused_lamb as fused_lamb

    class Builder:
        def load(self):
            return type("FusedLambOp", (), {"lamb": staticmethod(fake_fused_lamb_kernel)})

    monkeypatch.setattr(fused_lamb, "FusedLambBuilder", Builder)


@pytest.mark.parametrize("trust_ratio", [False, True])
@pytest.mark.parametrize("temperature_lr", [None, 1e-2], ids=["learnable", "rgcl_g"])
def test_both_devices_obey_the_temperature_switch(fused_lamb_on_cpu, trust_ratio, temperature_lr):
    from deepspeed.ops.lamb import FusedLamb

    optim = OptimConfig(lr=1e-3, weight_decay=0.1, temperature_trust_ratio=trust_ratio)
    results = {}
    for cuda in (False, True):
        model = TinyClip()
        optimizer = build_optimizer(_resolved_ds(), model, optim, cuda=cuda, temperature_lr=temperature_lr)
        assert isinstance(optimizer, FusedLamb if cuda else Lamb)
        groups = {g["name"]: g for g in optimizer.param_groups}
        name = "other.temperature" if temperature_lr is None else "temperature"
        assert groups[name]["params"] == [model.logit_scale]
        assert all("trust_ratio" not in g for g in optimizer.param_groups)
        bounds = {n: (g["max_coeff"], g["min_coeff"]) for n, g in groups.items()}
        assert bounds.pop(name) == ((10.0, 0.01) if trust_ratio else (1.0, 1.0))
        assert set(bounds.values()) == {(10.0, 0.01)}  # every other group keeps FusedLamb's bounds
        theta = model.logit_scale.item()
        model(torch.randn(3, 6, generator=torch.Generator().manual_seed(3))).sum().backward()
        optimizer.step()
        results[cuda] = [p.detach().clone() for p in model.parameters()]
        lr = groups[name]["lr"]
        moved = abs(model.logit_scale.item() - theta)
        # step 1: |u| = (1 - b1) / sqrt(1 - b2) (eps aside), the bias correction sqrt(1 - b2) / (1 - b1):
        # lr without the ratio, lr * |theta| * sqrt(1 - b2) / (1 - b1) with it (2.66 * 1.41 = 3.8 times more)
        correction = math.sqrt(1 - BETAS[1]) / (1 - BETAS[0])
        assert moved == pytest.approx(lr * theta * correction if trust_ratio else lr, rel=1e-4)
    for ours, fused in zip(results[False], results[True]):
        assert_matches(ours, fused.double())


def test_lamb_settings_from_the_deepspeed_json_reach_both_devices(fused_lamb_on_cpu):
    extra = {"bias_correction": False, "eps_inside_sqrt": True, "max_coeff": 5.0, "min_coeff": 0.1}
    for cuda in (False, True):
        optimizer = build_optimizer(_resolved_ds(**extra), TinyClip(), OptimConfig(), cuda=cuda)
        group = next(g for g in optimizer.param_groups if g["name"] == "other.decay")
        assert (group["bias_correction"], group["max_coeff"], group["min_coeff"]) == (False, 5.0, 0.1)
        assert optimizer.eps_mode == 0 if cuda else optimizer.eps_inside_sqrt
    with pytest.raises(ValueError, match=r"max_grad_norm.*gradient_clipping"):
        build_optimizer(_resolved_ds(max_grad_norm=1.0), TinyClip(), OptimConfig(), cuda=False)
    ds = json.loads((LAMB_JSON.parent / "zero1_bf16_adamw.json").read_text())
    ds["optimizer"]["params"].update(lr=1e-3, weight_decay=0.1, max_coeff=5.0)
    with pytest.raises(ValueError, match=r"does not pass on to AdamW: \['max_coeff'\]"):
        build_optimizer(ds, TinyClip(), OptimConfig(), cuda=False)


def test_a_checkpoint_does_not_bring_back_the_old_temperature_bounds():
    optim = OptimConfig(lr=1e-3, weight_decay=0.1)
    optimizer = build_optimizer(_resolved_ds(), TinyClip(), optim, cuda=False, temperature_lr=1e-2)
    saved = optimizer.state_dict()
    for group in saved["param_groups"]:  # as a FusedLamb checkpoint from before the switch holds them
        group.update(max_coeff=10.0, min_coeff=0.01, lr=5e-3)
    optimizer.load_state_dict(saved)
    temperature = next(g for g in optimizer.param_groups if g["name"] == "temperature")
    assert (temperature["max_coeff"], temperature["min_coeff"], temperature["lr"]) == (1.0, 1.0, 5e-3)


# ---- a real ZeRO-1 engine step -------------------------------------------------------------------------


def test_zero1_engine_steps_each_flat_partition_as_the_kernel_does():
    """DeepSpeed flattens each group into one fp32 partition (one rank: the whole group, padded) and hands
    those to the optimizer: the update, trust ratio included, is the kernel's on the flat partition."""
    import deepspeed

    from eva_fastclip.engine.trainer import init_process_group

    init_process_group()
    cfg = load_config(None, ["optim.lr=0.01", "optim.weight_decay=0.1", "optim.warmup_steps=0"])
    ds = _resolved_ds()
    ds["optimizer"]["params"].update(lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    ds.update(train_batch_size=3, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=1)
    model, reference = TinyClip(), TinyClip()  # the same weights; the reference gets no DeepSpeed
    optimizer = build_optimizer(ds, model, cfg.optim, cuda=False, temperature_lr=2e-2)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    assert groups == [["proj.weight"], ["proj.bias", "norm.weight", "norm.bias"], ["logit_scale"]]
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=build_scheduler(optimizer, cfg, total_steps=10),
        config={k: v for k, v in ds.items() if k != "optimizer"},
    )
    flat = engine.optimizer.single_partition_of_fp32_groups
    params = dict(reference.named_parameters())
    moments = [(torch.zeros(p.numel()), torch.zeros(p.numel())) for p in flat]
    g = torch.Generator().manual_seed(4)
    for step in (1, 2):
        x = torch.randn(3, 6, generator=g)
        engine.backward(engine(x).sum())
        reference.zero_grad()
        reference(x).sum().backward()
        settings = [dict(group) for group in engine.optimizer.param_groups]  # this step's lr (scheduled)
        engine.step()
        for i, (group, setting) in enumerate(zip(groups, settings)):
            pad = flat[i].numel() - sum(params[n].numel() for n in group)  # DeepSpeed's alignment
            assert 0 <= pad < 4
            w = torch.cat([params[n].detach().reshape(-1) for n in group] + [torch.zeros(pad)])
            grad = torch.cat([params[n].grad.reshape(-1) for n in group] + [torch.zeros(pad)])
            kwargs = {k: setting[k] for k in ("lr", "weight_decay", "max_coeff", "min_coeff")}
            w_new, m, v, coeff = kernel_step(w, grad, *moments[i], step, **kwargs)
            moments[i] = (m, v)
            assert_matches(flat[i], w_new)
            if step == 1 and len(group) > 1:  # per tensor the no-decay group would have moved otherwise
                per_tensor = [kernel_step(params[n], params[n].grad, 0 * params[n], 0 * params[n], 1,
                                          **kwargs)[3] for n in group]  # fmt: skip
                assert per_tensor[2] == 1.0 != coeff  # norm.bias alone: ||w|| = 0
            with torch.no_grad():  # the reference model follows the expected weights
                for n, part in zip(group, w_new.split([params[n].numel() for n in group] + [pad])):
                    params[n].copy_(part.view_as(params[n]))
        for n, p in model.named_parameters():  # the module's weights are the partitions'
            assert_matches(p, params[n].detach().double())
