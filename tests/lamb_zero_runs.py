"""The LAMB-under-ZeRO runs (tests/test_lamb_zero.py, tests/launched/test_lamb_zero_two_ranks.py): a model
whose loss is linear in its weights, each configuration's DeepSpeed engine for 3 steps, and the float64
per-tensor reference they are held to."""

import json
import math
import warnings

import pytest
import torch
from engine_state import full_state
from lamb_reference import LAMB_JSON, kernel_step
from torch import nn

from eva_fastclip.config import load_config
from eva_fastclip.engine.setup import initialize_engine
from eva_fastclip.optim.optimizer import build_optimizer
from eva_fastclip.optim.schedule import build_scheduler

STEPS = 3
RTOL = 1e-6
#: the multi-tensor step against today's, both in float64
REPLAY_RTOL = 1e-12
#: name -> (ZeRO stage, precision, extra DeepSpeed settings)
CONFIGS = {
    "zero0-fp32": (0, "fp32", {}),
    "zero1-fp32": (1, "fp32", {}),
    "zero2-fp32": (2, "fp32", {}),
    "zero0-bf16": (0, "bf16", {}),  # DeepSpeed's FP16_UnfusedOptimizer: fp32 copies of whole tensors
    "zero1-bf16": (1, "bf16", {}),
    "zero2-bf16": (2, "bf16", {}),
    # fp32 gradient accumulation: DeepSpeed's BF16_Optimizer, flat partitions of its own
    "zero1-bf16-fp32-grads": (1, "bf16", {"data_types": {"grad_accum_dtype": "fp32"}}),
}
ONE_RANK = ("zero0-fp32", "zero1-fp32", "zero0-bf16", "zero1-bf16", "zero1-bf16-fp32-grads")


class LinearLoss(nn.Module):
    """A decayed group with a tensor that 2 ranks split (proj.weight), a no-decay group with an all-zero
    tensor (norm.bias: ||w|| = 0, r = 1) and the temperature alone in its group (bounds 1: r = 1).
    Its weights are bf16 values, so that bf16 runs start from the same ones."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.proj = nn.Linear(7, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 3)
        self.logit_scale = nn.Parameter(torch.tensor([math.log(1 / 0.07)]))
        with torch.no_grad():
            for p in (self.proj.weight, self.proj.bias, self.head.weight, self.head.bias):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            for p in self.parameters():  # bf16 masters start from the bf16 module: the same values
                p.copy_(p.bfloat16())

    def forward(self, grads):
        return sum((p * g).sum() for p, g in zip(self.parameters(), grads))


def gradients(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    shapes = [p.shape for p in LinearLoss().parameters()]
    return [torch.randn(s, generator=g).bfloat16().float() for s in shapes]  # exact in bf16 too


def experiment(trust_ratio: str = "per_tensor"):
    return load_config(
        None,
        [
            "optim.lr=0.01",
            "optim.weight_decay=0.1",
            "optim.warmup_steps=0",
            f"optim.lamb_trust_ratio={trust_ratio}",
        ],
    )


def deepspeed_json(name: str, world: int) -> dict:
    stage, precision, extra = CONFIGS[name]
    ds = json.loads(LAMB_JSON.read_text())
    ds["optimizer"]["params"].update(lr=0.01, weight_decay=0.1)
    ds.update(gradient_clipping=0.0, train_batch_size=world, train_micro_batch_size_per_gpu=1)
    ds.update(gradient_accumulation_steps=1, bf16={"enabled": precision == "bf16"}, **extra)
    ds["zero_optimization"] = {**ds["zero_optimization"], "stage": stage}
    return ds


def run(name: str, world: int, checkpoint_dir: str | None = None, trust_ratio: str = "per_tensor"):
    """STEPS engine steps of configuration ``name``; the full state after each, and the float64 replays of
    every optimizer call (:func:`replay_in_float64`). With ``checkpoint_dir``, the engine saves after step
    2 and loads it back before step 3 (the fragments must survive a load)."""
    model = LinearLoss()
    ds = deepspeed_json(name, world)
    engine = initialize_engine(model, experiment(trust_ratio), ds, total_steps=10)
    dtype = torch.bfloat16 if CONFIGS[name][1] == "bf16" else torch.float32
    replays = replay_in_float64(engine.basic_optimizer)
    states = []
    for step in range(1, STEPS + 1):
        if checkpoint_dir is not None and step == STEPS:
            engine.save_checkpoint(checkpoint_dir, tag="two")
            engine.load_checkpoint(checkpoint_dir, tag="two")
        engine.backward(engine([g.to(dtype) for g in gradients(step)]))
        engine.step()
        states.append(full_state(engine))
    split = any(
        p._hp_mapping is not None and p._hp_mapping.lp_fragment_address.numel < p.numel()
        for p in model.parameters()
        if hasattr(p, "_hp_mapping")
    )
    return {"states": states, "split": split, "replays": replays}


#: the optimizer's group settings a replay copies
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff")


def replay_in_float64(optimizer) -> list[float]:
    """Make every call of ``optimizer.step`` (DeepSpeed calls it once per parameter group under ZeRO, with
    the flat partitions and their fragments) also run in float64 from the same inputs, once by today's
    Lamb (lamb_reference.TodaysLamb: a tensor and a fragment at a time) and once each way of the
    multi-tensor step (the CPU sweep, the CPU's compiled pass and fused kernel, with every fragment
    compiled however small, and CUDA's multi-tensor ops); each call appends the largest
    difference between them to the returned list, relative to each tensor's norm (weights, moments)."""
    errors: list[float] = []
    step = optimizer.step

    def replayed(*args, **kwargs):
        inputs = [
            (p, {k: g[k] for k in GROUP_KEYS}, {k: v for k, v in optimizer.state.get(p, {}).items()})
            for g in optimizer.param_groups
            for p in g["params"]
            if p.grad is not None
        ]
        copies = {p: (p.detach().double().clone(), p.grad.double().clone(), state) for p, _, state in inputs}
        out = step(*args, **kwargs)
        runs = [_replay(optimizer, inputs, copies, kind) for kind in ("today", "sweep", "fused", "multi")]
        for other in runs[1:]:
            errors.append(max(relative_error(a, b) for a, b in zip(other, runs[0])))
        return out

    optimizer.step = replayed
    return errors


def _replay(optimizer, inputs, copies, kind: str) -> list[torch.Tensor]:
    """One optimizer call again in float64 by ``kind``: its weights and moments afterwards."""
    from lamb_reference import TodaysLamb

    from eva_fastclip.optim import lamb_fused_cpu
    from eva_fastclip.optim.lamb import Lamb

    params = {p: nn.Parameter(copies[p][0].clone()) for p, _, _ in inputs}
    for p, (_, grad, _) in copies.items():
        params[p].grad = grad.clone()
    cls = TodaysLamb if kind == "today" else Lamb
    fresh = cls([{"params": [params[p]], **settings} for p, settings, _ in inputs], lr=0.01)
    fresh.eps_inside_sqrt, fresh.cpu_walk = optimizer.eps_inside_sqrt, kind
    for p, _, state in inputs:
        if state:
            fresh.state[params[p]] = {
                "step": state["step"],
                **{k: state[k].double().clone() for k in ("exp_avg", "exp_avg_sq")},
            }
    if optimizer._fragments is not None:
        frags = [(params[p], optimizer._fragments[id(p)][1]) for p, _, _ in inputs]
        fresh.set_fragments(frags, optimizer._num_tensors, process_group=optimizer._reduce_over)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lamb_fused_cpu, "EAGER_BELOW", 0)
        fresh.step()
    return [
        t
        for p, _, _ in inputs
        for t in (params[p], *(fresh.state[params[p]][k] for k in ("exp_avg", "exp_avg_sq")))
    ]


def reference() -> list[dict[str, tuple[torch.Tensor, ...]]]:
    """Per-tensor LAMB in float64 over the groups and schedule build_optimizer gives, without DeepSpeed."""
    model = LinearLoss()
    cfg = experiment()
    optimizer = build_optimizer(deepspeed_json("zero0-fp32", 1), model, cfg.optim, cuda=False)
    scheduler = build_scheduler(optimizer, cfg, total_steps=10)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {n: (p.detach().double(), torch.zeros_like(p.double()), torch.zeros_like(p.double()))
             for n, p in model.named_parameters()}  # fmt: skip
    states = []
    for step in range(1, STEPS + 1):
        grads = dict(zip([n for n, _ in model.named_parameters()], gradients(step)))
        for group in optimizer.param_groups:
            settings = {k: group[k] for k in ("lr", "weight_decay", "max_coeff", "min_coeff")}
            for p in group["params"]:
                name = names[id(p)]
                w, m, v = state[name]
                w, m, v, _ = kernel_step(w, grads[name], m, v, step, **settings)
                state[name] = (w, m, v)
        with warnings.catch_warnings():  # it warns that no optimizer.step() came first: none ever comes
            warnings.simplefilter("ignore")
            scheduler.step()
        states.append(dict(state))
    return states


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_per_tensor(result, expected, label: str, bf16: bool) -> None:
    for step, (got, want) in enumerate(zip(result["states"], expected), start=1):
        for name, (w, m, v) in want.items():
            master, exp_avg, exp_avg_sq, module = got[name]
            for what, a, b in (("weight", master, w), ("exp_avg", exp_avg, m), ("exp_avg_sq", exp_avg_sq, v)):
                error = relative_error(a, b)
                assert error <= RTOL, f"{label} step {step} {name} {what}: relative error {error:.2e}"
            # the module holds the masters (rounded to bf16 where it runs in bf16)
            rounded = master.to(torch.bfloat16 if bf16 else torch.float32).double()
            assert torch.equal(module, rounded), f"{label} step {step} {name}: module weight not the master's"


def assert_replays_agree(result: dict, label: str) -> None:
    """Every replayed call: the multi-tensor step within REPLAY_RTOL of today's, in float64."""
    replays = result["replays"]
    assert replays, f"{label}: no optimizer call was replayed"
    assert max(replays) <= REPLAY_RTOL, f"{label}: the multi-tensor step differs by {max(replays):.2e}"
