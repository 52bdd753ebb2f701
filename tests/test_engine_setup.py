import json
import math
from pathlib import Path

import pytest
import torch

from eva_fastclip.config import BatchLayout, ConfigError, OptimConfig, load_config
from eva_fastclip.engine.setup import (
    autocast_dtype,
    build_optimizer,
    build_scheduler,
    load_deepspeed_config,
    resolve_deepspeed_config,
)
from eva_fastclip.models import parameter_groups

DS_CONFIGS = sorted((Path(__file__).parents[1] / "ds_configs").glob("*.json"))


def resolve(ds, cfg=None, world_size=2, cuda=False):
    cfg = cfg or load_config(None, ["train.batch_size=8", "train.grad_accum_steps=2"])
    layout = BatchLayout(cfg.train.batch_size, cfg.train.grad_accum_steps, world_size)
    return resolve_deepspeed_config(ds, cfg, layout, source="test.json", cuda=cuda)


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_resolve(path):
    ds = load_deepspeed_config(path)
    is_fp16 = ds.get("fp16", {}).get("enabled", False)
    resolved = resolve(ds, cuda=is_fp16)  # fp16 only resolves where CUDA is (or is pretended to be) present
    assert resolved["train_micro_batch_size_per_gpu"] == 8
    assert resolved["gradient_accumulation_steps"] == 2
    assert resolved["train_batch_size"] == 32
    assert resolved["optimizer"]["params"]["lr"] == 1e-3
    assert resolved["zero_optimization"]["stage"] in (1, 2)


def test_fp16_on_cpu_is_refused_with_the_alternative():
    ds = load_deepspeed_config(Path("ds_configs/zero1_fp16_lamb.json"))
    with pytest.raises(ConfigError, match="zero1_bf16_lamb.json"):
        resolve(ds, cuda=False)


@pytest.mark.parametrize(
    "patch, message",
    [
        (
            {"train_micro_batch_size_per_gpu": 4},
            "train_micro_batch_size_per_gpu=4 but the experiment config gives 8",
        ),
        ({"train_batch_size": 64}, "train_batch_size=64 but the experiment config gives 32"),
        ({"gradient_accumulation_steps": 1}, "(train.grad_accum_steps)"),
        ({"scheduler": {"type": "WarmupLR"}}, "remove the section"),
        ({"optimizer": {"type": "SGD"}}, "needs an 'optimizer' section"),
        ({"zero_optimization": {"stage": 3}}, "stage=3"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both fp16 and bf16"),
    ],
)
def test_disagreements_name_the_value_to_change(patch, message):
    ds = {**json.loads(Path("ds_configs/zero1_bf16_lamb.json").read_text()), **patch}
    with pytest.raises(ConfigError) as err:
        resolve(ds, cuda=True)
    assert message in str(err.value)


def test_matching_concrete_values_are_accepted():
    ds = {**json.loads(Path("ds_configs/zero1_bf16_lamb.json").read_text()), "train_batch_size": 32}
    assert resolve(ds)["train_batch_size"] == 32


def test_dtype_and_optimizer_groups():
    assert autocast_dtype({"bf16": {"enabled": True}}) == torch.bfloat16
    assert autocast_dtype({"fp16": {"enabled": True}}) == torch.float16
    assert autocast_dtype({}) == torch.float32

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model.logit_scale = torch.nn.Parameter(torch.ones(1))
    model.token_embedding = torch.nn.Embedding(10, 4)
    groups = parameter_groups(model, OptimConfig(weight_decay=0.1))
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[0].weight)}  # biases, norms, embeddings, temperature: no decay
    assert all(g["weight_decay"] in (0.0, 0.1) for g in groups)

    cfg = load_config(None, ["train.batch_size=8", "train.grad_accum_steps=2"])
    ds = resolve(load_deepspeed_config(Path("ds_configs/zero1_bf16_lamb.json")), cfg)
    optimizer = build_optimizer(ds, model, cfg.optim, cuda=False)
    assert type(optimizer).__name__ == "Lamb"
    # token_embedding is a text-tower name (no block list: one text group); the rest is in neither tower
    assert {g["name"]: (g["lr"], g["weight_decay"]) for g in optimizer.param_groups} == {
        "text.no_decay": (1e-3, 0.0),
        "other.decay": (1e-3, 0.1),
        "other.no_decay": (1e-3, 0.0),
    }
    ds = resolve(load_deepspeed_config(Path("ds_configs/zero1_bf16_adamw.json")), cfg)
    assert isinstance(build_optimizer(ds, model, cfg.optim, cuda=False), torch.optim.AdamW)


def test_cpu_adamw_is_the_fused_kernel_and_takes_the_written_out_step():
    cfg = load_config(None, ["train.batch_size=8", "train.grad_accum_steps=2", "optim.weight_decay=0.1"])
    ds = resolve(load_deepspeed_config(Path("ds_configs/zero1_bf16_adamw.json")), cfg)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    optimizer = build_optimizer(ds, model, cfg.optim, cuda=False)
    assert optimizer.defaults["fused"] is True  # one pass over the weights, not one per foreach op
    w0 = model.weight.detach().double().clone()
    grads = [torch.randn(3, 5) for _ in range(2)]
    m = v = torch.zeros_like(w0)
    (beta1, beta2), eps, lr, wd = ds["optimizer"]["params"]["betas"], 1e-6, cfg.optim.lr, 0.1
    w = w0
    for t, g in enumerate(grads, start=1):  # AdamW (Loshchilov & Hutter), decoupled decay, in float64
        model.weight.grad, model.bias.grad = g.clone(), torch.zeros(3)
        optimizer.step()
        g = g.double()
        m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        w = w * (1 - lr * wd) - lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
    assert ds["optimizer"]["params"]["eps"] == eps
    torch.testing.assert_close(model.weight.detach().double(), w, rtol=0, atol=1e-6)
    assert not torch.allclose(w, w0)


def test_schedule_warms_up_linearly_then_decays_by_cosine():
    cfg = load_config(None, ["optim.lr=1.0", "optim.warmup_steps=4", "optim.min_lr_ratio=0.1"])
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(
        [{"params": [model.weight], "lr": 1.0}, {"params": [model.bias], "lr": 0.5}], lr=1.0
    )
    scheduler = build_scheduler(optimizer, cfg, total_steps=14)
    lrs = []
    for _ in range(14):
        lrs.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    first = [lr for lr, _ in lrs]
    assert first[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])  # the first step already learns
    # after warm-up: 0.1 + 0.9 * (1 + cos(pi * (s - 4) / 10)) / 2, written out for s = 9 and s = 13
    assert first[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert first[13] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    assert all(a >= b for a, b in zip(first[3:], first[4:]))
    assert all(b == pytest.approx(0.5 * a) for a, b in lrs)  # each group keeps its own peak


ALLOCATE_TWICE = """
import resource, sys, torch
from eva_fastclip.engine.trainer import keep_freed_host_memory
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
faults = []
for _ in range(3):  # 64 MiB: above the largest threshold below which glibc would reuse freed blocks anyway
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 * 2**20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[-1])
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="glibc/Linux only")
def test_freed_host_memory_is_reused_without_page_faults():
    import subprocess
    import sys

    def faults(mode):
        out = subprocess.run([sys.executable, "-c", ALLOCATE_TWICE, mode], check=True, capture_output=True)
        return int(out.stdout.decode().split()[-1])

    pages = 64 * 2**20 // 4096
    assert faults("default") > pages // 2  # glibc maps a fresh block and faults in every page again
    assert faults("keep") < pages // 100  # the block freed by the previous allocation is reused
