"""Our LAMB against DeepSpeed's FusedLamb kernel, rewritten in float64 from
csrc/lamb/fused_lamb_cuda_kernel.cu (tests/lamb_reference.py): single tensors, several steps, the trust
ratio at both clipping bounds, tensors cut into fragments of flat buffers (as ZeRO lays them out) still
stepped per tensor, the temperature switch on both devices, and ``per_zero_partition``: a real ZeRO-1
engine step per flat partition, as FusedLamb takes it. tests/test_lamb_zero.py runs the engines of every
ZeRO stage on 1 and 2 ranks."""

import json
import math

import pytest
import torch
from lamb_reference import BETAS, EPS, LAMB_JSON, kernel_step
from torch import nn

from eva_fastclip.config import ConfigError, OptimConfig, load_config
from eva_fastclip.engine.setup import initialize_engine
from eva_fastclip.optim import lamb_fused_cpu
from eva_fastclip.optim.lamb import Fragment, Lamb, attach_zero_partitions
from eva_fastclip.optim.optimizer import build_optimizer

#: the CPU's ways of walking memory (Lamb.cpu_walk) that take the kernel's step
WALKS = ("sweep", "fused", "multi")


@pytest.fixture
def walk_of(monkeypatch):
    """Sets a Lamb's cpu_walk; the fused walk compiles every fragment, however small (in a run, fragments
    under lamb_fused_cpu.EAGER_BELOW elements are measured eagerly)."""
    monkeypatch.setattr(lamb_fused_cpu, "EAGER_BELOW", 0)

    def set_walk(optimizer: Lamb, walk: str) -> Lamb:
        optimizer.cpu_walk = walk
        return optimizer

    return set_walk


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


@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize(
    "options",
    [{}, {"bias_correction": False}, {"eps_inside_sqrt": True}, {"eps": 1e-2}],
    ids=["default", "no-bias-correction", "eps-inside-sqrt", "large-eps"],
)
def test_steps_match_the_kernel(options, walk, walk_of):
    if walk == "fused" and options.get("eps_inside_sqrt"):
        pytest.skip("the fused walk refuses eps_inside_sqrt: test_the_fused_walk_says_why_it_cannot_run")
    cases = _tensors()
    params = [nn.Parameter(value.clone()) for _, value, _ in cases]
    lr = 1e-2
    optimizer = Lamb(
        [{"params": [p], **settings} for p, (_, _, settings) in zip(params, cases)],
        lr=lr,
        betas=BETAS,
        **{"eps": EPS, **options},
    )
    walk_of(optimizer, walk)
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


#: (CUDA present, optim.lamb_trust_ratio): ours on CPU, ours on CUDA, FusedLamb (CUDA, DeepSpeed's rule)
DEVICES_AND_RULES = [(False, "per_tensor"), (True, "per_tensor"), (True, "per_zero_partition")]


@pytest.mark.parametrize("trust_ratio", [False, True])
@pytest.mark.parametrize("temperature_lr", [None, 1e-2], ids=["learnable", "rgcl_g"])
def test_both_devices_obey_the_temperature_switch(fused_lamb_on_cpu, trust_ratio, temperature_lr):
    from deepspeed.ops.lamb import FusedLamb

    results = {}
    for cuda, rule in DEVICES_AND_RULES:
        optim = OptimConfig(
            lr=1e-3, weight_decay=0.1, temperature_trust_ratio=trust_ratio, lamb_trust_ratio=rule
        )
        model = TinyClip()
        optimizer = build_optimizer(_resolved_ds(), model, optim, cuda=cuda, temperature_lr=temperature_lr)
        fused = cuda and rule == "per_zero_partition"  # FusedLamb only for DeepSpeed's own rule
        assert isinstance(optimizer, FusedLamb if fused else Lamb)
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
        results[cuda, rule] = [p.detach().clone() for p in model.parameters()]
        lr = groups[name]["lr"]
        moved = abs(model.logit_scale.item() - theta)
        # step 1: |u| = (1 - b1) / sqrt(1 - b2) (eps aside), the bias correction sqrt(1 - b2) / (1 - b1):
        # lr without the ratio, lr * |theta| * sqrt(1 - b2) / (1 - b1) with it (2.66 * 1.41 = 3.8 times more)
        correction = math.sqrt(1 - BETAS[1]) / (1 - BETAS[0])
        assert moved == pytest.approx(lr * theta * correction if trust_ratio else lr, rel=1e-4)
    for cuda, rule in DEVICES_AND_RULES[1:]:
        for ours, other in zip(results[DEVICES_AND_RULES[0]], results[cuda, rule]):
            assert_matches(ours, other.double())


def test_lamb_settings_from_the_deepspeed_json_reach_both_devices(fused_lamb_on_cpu):
    extra = {"bias_correction": False, "eps_inside_sqrt": True, "max_coeff": 5.0, "min_coeff": 0.1}
    for cuda, rule in DEVICES_AND_RULES:
        optim = OptimConfig(lamb_trust_ratio=rule)
        optimizer = build_optimizer(_resolved_ds(**extra), TinyClip(), optim, cuda=cuda)
        group = next(g for g in optimizer.param_groups if g["name"] == "other.decay")
        assert (group["bias_correction"], group["max_coeff"], group["min_coeff"]) == (False, 5.0, 0.1)
        fused = cuda and rule == "per_zero_partition"
        assert optimizer.eps_mode == 0 if fused else optimizer.eps_inside_sqrt
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


# ---- per_zero_partition: a real ZeRO-1 engine step ------------------------------------------------------


def test_per_zero_partition_steps_each_flat_partition_as_the_kernel_does():
    """``optim.lamb_trust_ratio=per_zero_partition``: DeepSpeed flattens each group into one fp32
    partition (one rank: the whole group, padded) and hands those to the optimizer; the update, trust ratio
    included, is the kernel's on the flat partition, as FusedLamb steps it under ZeRO."""
    from eva_fastclip.reliability.process import init_process_group

    init_process_group()
    sets = ["optim.lr=0.01", "optim.weight_decay=0.1", "optim.warmup_steps=0"]
    cfg = load_config(None, [*sets, "optim.lamb_trust_ratio=per_zero_partition"])
    ds = _resolved_ds()
    ds["optimizer"]["params"].update(lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    ds.update(train_batch_size=3, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=1)
    model, reference = TinyClip(), TinyClip()  # the same weights; the reference gets no DeepSpeed
    names = {id(p): n for n, p in reference.named_parameters()}
    built = build_optimizer(ds, reference, cfg.optim, cuda=False, temperature_lr=2e-2).param_groups
    groups = [[names[id(p)] for p in g["params"]] for g in built]
    assert groups == [["proj.weight"], ["proj.bias", "norm.weight", "norm.bias"], ["logit_scale"]]
    engine = initialize_engine(model, cfg, ds, total_steps=10, temperature_lr=2e-2)
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


# ---- per tensor across fragments of flat buffers -------------------------------------------------------


def _flat_layout():
    """Two flat "partitions" of one decayed group and one of a no-decay group, as ZeRO lays them out:
    tensors back to back with alignment padding between them and at the end, ``matrix`` cut in two across
    both decayed partitions. Returns (tensors, [(settings, [(tensor, tensor start, flat start, length)],
    flat size)])."""
    g = torch.Generator().manual_seed(7)
    tensors = {
        "matrix": torch.randn(6, 5, generator=g),
        "other": torch.randn(4, generator=g),
        "bias": torch.randn(3, generator=g) * 0.1,
        "zero": torch.zeros(5),  # ||w|| = 0: ratio 1
        "big": torch.full((4,), 1e3),  # ratio far above max_coeff
        "tiny": torch.randn(6, generator=g) * 1e-6,  # far below min_coeff
    }
    layout = [
        ({"weight_decay": 0.1}, [("matrix", 0, 0, 17)], 18),  # one element of padding at the end
        ({"weight_decay": 0.1}, [("matrix", 17, 0, 13), ("other", 0, 14, 4)], 20),
        ({"weight_decay": 0.0},
         [("bias", 0, 0, 3), ("zero", 0, 4, 5), ("big", 0, 9, 4), ("tiny", 0, 14, 6)], 20),
    ]  # fmt: skip
    return tensors, layout


@pytest.mark.parametrize("walk", WALKS)
def test_fragments_of_flat_buffers_step_per_tensor(walk, walk_of):
    """Each tensor's ratio comes from its whole norms, summed over the fragments, wherever they lie; padding
    never moves. The float64 per-tensor kernel is the reference."""
    tensors, layout = _flat_layout()
    order = list(tensors)
    flats = []
    for _, pieces, size in layout:
        flat = torch.full((size,), 0.0)
        for name, src, dst, length in pieces:
            flat[dst : dst + length] = tensors[name].reshape(-1)[src : src + length]
        flats.append(nn.Parameter(flat))
    lr = 1e-2
    optimizer = Lamb([{"params": [f], **settings} for f, (settings, _, _) in zip(flats, layout)],
                     lr=lr, betas=BETAS, eps=EPS)  # fmt: skip
    fragments = [
        (f, [Fragment(order.index(name), dst, length) for name, _, dst, length in pieces])
        for f, (_, pieces, _) in zip(flats, layout)
    ]
    optimizer.set_fragments(fragments, num_tensors=len(order))
    walk_of(optimizer, walk)
    decay = {name: settings["weight_decay"] for settings, pieces, _ in layout for name, *_ in pieces}
    expected = {n: (t.double(), torch.zeros(t.shape).double(), torch.zeros(t.shape).double())
                for n, t in tensors.items()}  # fmt: skip
    g = torch.Generator().manual_seed(8)
    for step in range(1, 4):
        grads = {n: torch.randn(t.shape, generator=g) for n, t in tensors.items()}
        for f, (_, pieces, size) in zip(flats, layout):
            f.grad = torch.zeros(size)
            for name, src, dst, length in pieces:
                f.grad[dst : dst + length] = grads[name].reshape(-1)[src : src + length]
        optimizer.step()
        coeffs = {}
        for name in order:
            w, m, v = expected[name]
            w, m, v, coeffs[name] = kernel_step(w, grads[name], m, v, step, lr=lr, weight_decay=decay[name])
            expected[name] = (w, m, v)
        assert optimizer.get_lamb_coeffs() == pytest.approx([coeffs[n] for n in order], rel=1e-5)
        if step == 1:  # every case did what it is there for
            assert (coeffs["zero"], coeffs["big"], coeffs["tiny"]) == (1.0, 10.0, 0.01)
        for f, (_, pieces, size) in zip(flats, layout):
            covered = torch.zeros(size, dtype=torch.bool)
            for name, src, dst, length in pieces:
                assert_matches(f[dst : dst + length], expected[name][0].reshape(-1)[src : src + length])
                assert_matches(optimizer.state[f]["exp_avg"][dst : dst + length],
                               expected[name][1].reshape(-1)[src : src + length])  # fmt: skip
                covered[dst : dst + length] = True
            assert torch.all(f[~covered] == 0), "padding moved"
    # per flat buffer instead: the trust ratio of "matrix" would be two different ones
    per_partition = [kernel_step(f.detach(), f.grad, 0 * f, 0 * f, 1, lr=lr, weight_decay=0.1)[3]
                     for f in flats[:2]]  # fmt: skip
    assert per_partition[0] != pytest.approx(per_partition[1], rel=1e-3)


def test_a_flat_parameter_without_fragments_is_refused():
    """Once fragments are set, a parameter without them (its tensors unknown) stops the step with the fix."""
    known, unknown = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    optimizer = Lamb([known, unknown])
    optimizer.set_fragments([(known, [Fragment(0, 0, 4)])], num_tensors=1)
    known.grad, unknown.grad = torch.ones(4), torch.ones(4)
    with pytest.raises(RuntimeError, match="attach_zero_partitions"):
        optimizer.step()
    with pytest.raises(ValueError, match="overlaps"):
        optimizer.set_fragments([(known, [Fragment(0, 0, 3), Fragment(0, 2, 2)])], num_tensors=1)


def test_unknown_flat_parameters_name_the_option_that_keeps_deepspeeds_rule():
    """Flat parameters without DeepSpeed's fragment addresses (a wrapper we do not know) cannot be stepped
    per tensor: the error names optim.lamb_trust_ratio."""
    tensors = [nn.Parameter(torch.ones(2, 3)), nn.Parameter(torch.ones(3))]
    optimizer = Lamb([nn.Parameter(torch.ones(9))])
    with pytest.raises(RuntimeError, match="lamb_trust_ratio"):
        attach_zero_partitions(optimizer, tensors)
    assert attach_zero_partitions(Lamb(tensors), tensors) is False  # whole tensors: per tensor already


def test_the_trust_ratio_rule_is_validated():
    with pytest.raises(ConfigError, match="optim.lamb_trust_ratio must be one of"):
        OptimConfig(lamb_trust_ratio="per_partition")


@pytest.mark.parametrize(
    "arch_list, base",
    [
        ("9.0a", "9.0"),
        ("8.0;9.0a", "8.0;9.0"),
        ("9.0a+PTX", "9.0+PTX"),
        ("10.0a 12.0", "10.0 12.0"),
        ("8.6", "8.6"),
    ],
)
def test_the_fused_optimizers_build_for_the_base_of_an_arch_specific_cuda_arch(arch_list, base):
    """DeepSpeed 0.19.8's op builder reads each TORCH_CUDA_ARCH_LIST entry as below (builder.py,
    compute_capability_args) and fails on 9.0a, which H100 / H200 images set (seen on an H200, 2026-11-27)."""
    from eva_fastclip.optim.optimizer import base_cuda_archs

    def deepspeed_reads(arch_list):
        ccs = arch_list.replace(" ", ";").split(";")
        return [tuple(int(part.split("+")[0]) for part in cc.split(".")) for cc in ccs]

    assert base_cuda_archs(arch_list) == base
    deepspeed_reads(base_cuda_archs(arch_list))
    if base != arch_list:
        with pytest.raises(ValueError):
            deepspeed_reads(arch_list)


@pytest.mark.parametrize("walk", WALKS)
def test_a_channels_last_weight_steps_as_the_kernel_does(walk, walk_of):
    """A tensor that is not contiguous (a conv weight in channels-last layout) takes the kernel's step too,
    whichever way the step walks memory."""
    g = torch.Generator().manual_seed(3)
    w = nn.Parameter(torch.randn(4, 3, 2, 2, generator=g).to(memory_format=torch.channels_last))
    assert not w.is_contiguous()
    optimizer = Lamb([{"params": [w], "weight_decay": 0.1}], lr=1e-2, betas=BETAS, eps=EPS)
    walk_of(optimizer, walk)
    expected, m, v = w.detach().double(), torch.zeros(w.shape).double(), torch.zeros(w.shape).double()
    for step in (1, 2):
        grad = torch.randn(w.shape, generator=g)
        w.grad = grad.to(memory_format=torch.channels_last)
        optimizer.step()
        expected, m, v, _ = kernel_step(expected, grad, m, v, step, lr=1e-2, weight_decay=0.1)
        assert_matches(w, expected)


def _steps_of(walk: str, steps: int = 3, **options) -> tuple[list[torch.Tensor], str]:
    """A 64 x 96 matrix and a bias stepped ``steps`` times by ``walk``: the weights and moments, and the
    walk the last step took."""
    g = torch.Generator().manual_seed(11)
    params = [nn.Parameter(torch.randn(64, 96, generator=g)), nn.Parameter(torch.randn(96, generator=g))]
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:]}]
    optimizer = Lamb(groups, lr=1e-2, **options)
    optimizer.cpu_walk = walk
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    moments = [optimizer.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    state = [p.detach() for p in params] + moments
    return state, optimizer.last_walk


def test_the_auto_walk_fuses_a_step_large_enough_to_pay_for_the_compile(monkeypatch):
    swept, walk = _steps_of("sweep")
    assert walk == "sweep"
    monkeypatch.setattr(lamb_fused_cpu, "MIN_ELEMENTS", 64 * 96 + 96 + 1)
    assert _steps_of("auto")[1] == "sweep"  # one element short
    monkeypatch.setattr(lamb_fused_cpu, "MIN_ELEMENTS", 64 * 96 + 96)
    fused, walk = _steps_of("auto")
    assert walk == "fused"
    for a, b in zip(fused, swept):  # fp32, the same values up to rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_fused_walk_says_why_it_cannot_run():
    with pytest.raises(ValueError, match="fused CPU step cannot run: eps_inside_sqrt"):
        _steps_of("fused", eps_inside_sqrt=True)
    assert _steps_of("auto", eps_inside_sqrt=True)[1] == "sweep"


def test_a_failed_compile_steps_by_the_sweep_and_says_so(monkeypatch, caplog):
    """A machine where inductor cannot compile (here: no C++ compiler it can run) steps by the sweep, with a
    warning; asked for by name, the fused walk raises instead."""
    import torch._dynamo
    import torch._inductor.config as inductor

    monkeypatch.setattr(lamb_fused_cpu, "_compiled", None)
    monkeypatch.setattr(lamb_fused_cpu, "_unavailable", False)
    monkeypatch.setattr(lamb_fused_cpu, "MIN_ELEMENTS", 0)
    torch._dynamo.reset()
    # inductor's own patch (monkeypatch's undo deletes a config entry); a cached kernel needs no compiler
    no_compiler = inductor.patch({"cpp.cxx": ("/nonexistent/g++",), "fx_graph_cache": False})
    try:
        with no_compiler, pytest.raises(Exception, match="g\\+\\+|compiler|Compiler"):
            _steps_of("fused", steps=1)
        swept, _ = _steps_of("sweep")
        with no_compiler, caplog.at_level("WARNING"):
            fell_back, walk = _steps_of("auto")
        assert walk == "sweep" and "failed" in caplog.text and "sweep" in caplog.text
        for a, b in zip(fell_back, swept):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        torch._dynamo.reset()  # the next test compiles with the real compiler


def test_the_fused_walk_compiles_one_graph_for_every_kind_of_tensor():
    """Matrices, vectors, a conv weight and fragments of a flat buffer share one graph: no recompile when
    the next tensor has another shape, or in later steps (the trainer logs recompiles; past dynamo's limit
    under train.compile they raise)."""
    from eva_fastclip.engine.compiled import compiled_frames

    g = torch.Generator().manual_seed(12)
    shapes = [(64, 96), (5000,), (16, 3, 16, 16), (96, 64)]
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    flat = nn.Parameter(torch.randn(20000, generator=g))
    whole = Lamb([{"params": params, "weight_decay": 0.1}], lr=1e-2)
    split = Lamb([flat], lr=1e-2)
    split.set_fragments([(flat, [Fragment(0, 0, 7000), Fragment(1, 7001, 9000)])], num_tensors=2)
    frames = []
    for _ in range(3):
        for optimizer in (whole, split):
            optimizer.cpu_walk = "fused"
            for p in [*params, flat]:
                p.grad = torch.randn(p.shape, generator=g)
            before = compiled_frames()
            optimizer.step()
            assert optimizer.last_walk == "fused"
            frames.append(compiled_frames() - before)
    assert frames[0] <= 1 and sum(frames[1:]) == 0, frames
