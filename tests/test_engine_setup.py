import json
import math
from pathlib import Path

import pytest
import torch

from eva_fastclip.config import ConfigError, OptimConfig, load_config
from eva_fastclip.optim.optimizer import build_optimizer
from eva_fastclip.optim.param_groups import parameter_groups
from eva_fastclip.optim.schedule import build_scheduler
from eva_fastclip.plan.deepspeed_json import (
    autocast_dtype,
    load_deepspeed_config,
    resolve_deepspeed_config,
    resolve_precision,
)
from eva_fastclip.plan.layout import BatchLayout
from eva_fastclip.plan.precision import FP16_DEFAULTS, Hardware

DS_CONFIGS = sorted((Path(__file__).parents[1] / "ds_configs").glob("*.json"))


def resolve(ds, cfg=None, world_size=2, cuda=False, native_bf16=True):
    cfg = cfg or load_config(None, ["train.batch_size=8", "train.grad_accum_steps=2"])
    layout = BatchLayout(cfg.train.batch_size, cfg.train.grad_accum_steps, world_size)
    hardware = Hardware(cuda=cuda, native_bf16=native_bf16, description="a test device")
    return resolve_deepspeed_config(ds, cfg, layout, source="test.json", hardware=hardware)


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_resolve(path):
    ds = load_deepspeed_config(path)
    is_fp16 = ds.get("fp16", {}).get("enabled", False)
    resolved = resolve(ds, cuda=is_fp16)  # fp16 only resolves where CUDA is (or is pretended to be) present
    assert resolved["train_micro_batch_size_per_gpu"] == 8
    assert resolved["gradient_accumulation_steps"] == 2
    assert resolved["train_batch_size"] == 32
    assert resolved["optimizer"]["params"]["lr"] == 1e-3
    assert resolved["zero_optimization"]["stage"] in (0, 1, 2)


@pytest.mark.parametrize(
    "stage, setting, native_bf16, expected",
    [
        (0, "auto", True, "autocast"),  # bf16 by autocast over fp32 weights
        (0, "auto", False, "fp32"),  # nothing to autocast to
        (1, "auto", True, "deepspeed-bf16"),  # ZeRO-1/2 keep DeepSpeed's bf16 module
        (0, False, True, "deepspeed-bf16"),
    ],
)
def test_bf16_runs_by_autocast_at_stage_0_where_the_json_asks(stage, setting, native_bf16, expected):
    from eva_fastclip.engine.setup import steps_model_tensors

    ds = json.loads(Path("ds_configs/zero0_lamb.json").read_text())
    ds["zero_optimization"]["stage"] = stage
    ds["torch_autocast"]["enabled"] = setting
    resolved = resolve(ds, native_bf16=native_bf16)
    autocast, bf16 = resolved["torch_autocast"]["enabled"], resolved["bf16"]["enabled"]
    assert {(True, False): "autocast", (False, True): "deepspeed-bf16", (False, False): "fp32"}[
        autocast, bf16
    ] == expected
    assert resolved["torch_autocast"]["dtype"] == "bfloat16"
    # the optimizer steps the model's own tensors (and clips and guards them) at stage 0 without a wrapper
    assert steps_model_tensors(resolved) == (stage == 0 and expected != "deepspeed-bf16")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"stage": 1, "enabled": True}, r"enables torch_autocast at ZeRO stage 1: .* for stage 0"),
        ({"dtype": "float16"}, r"torch_autocast.dtype='float16': .* bfloat16 only"),
        ({"enabled": "yes"}, r'torch_autocast.enabled must be true, false or "auto"'),
    ],
)
def test_autocast_settings_that_cannot_run_are_refused(change, message):
    ds = json.loads(Path("ds_configs/zero0_lamb.json").read_text())
    ds["zero_optimization"]["stage"] = change.pop("stage", 0)
    ds["torch_autocast"].update(change)
    with pytest.raises(ConfigError, match=message):
        resolve(ds)


def precision_of(ds):
    return "bf16" if ds["bf16"]["enabled"] else "fp16" if ds["fp16"]["enabled"] else "fp32"


@pytest.mark.parametrize(
    "cuda, native_bf16, expected",
    [(True, True, "bf16"), (True, False, "fp16"), (False, True, "bf16"), (False, False, "fp32")],
    ids=["cuda-bf16", "cuda-no-bf16", "cpu-avx512-bf16", "cpu-avx2"],
)
def test_auto_precision_follows_the_hardware(cuda, native_bf16, expected):
    ds = resolve(
        load_deepspeed_config(Path("ds_configs/zero1_lamb.json")), cuda=cuda, native_bf16=native_bf16
    )
    assert precision_of(ds) == expected
    assert (
        autocast_dtype(ds) == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[expected]
    )
    if expected == "fp16":  # SPEC's dynamic loss scaling, from the JSON's own fp16 section
        assert ds["fp16"]["loss_scale"] == 0 and ds["fp16"]["initial_scale_power"] == 16


def test_auto_precision_without_sections_fills_the_loss_scaling():
    ds = json.loads(Path("ds_configs/zero1_lamb.json").read_text())
    del ds["bf16"], ds["fp16"]
    ds = resolve(ds, cuda=True, native_bf16=False)
    assert ds["fp16"] == {**FP16_DEFAULTS, "enabled": True} and ds["bf16"]["enabled"] is False


def test_explicit_precision_is_kept_and_warned_about_where_emulated():
    cfg = load_config(None, ["train.batch_size=8", "train.grad_accum_steps=2", "train.precision=bf16"])
    ds = json.loads(Path("ds_configs/zero1_lamb.json").read_text())
    avx2 = Hardware(cuda=False, native_bf16=False, description="CPU (AVX2)")
    choice = resolve_precision(cfg, ds, source="x.json", hardware=avx2)
    assert choice.name == "bf16" and "emulates" in choice.warning
    assert precision_of(resolve(ds, cfg, native_bf16=False)) == "bf16"
    # a JSON that fixes a precision is an explicit choice too
    fixed = json.loads(Path("ds_configs/zero1_bf16_lamb.json").read_text())
    cfg_auto = load_config(None, ["train.batch_size=8", "train.grad_accum_steps=2"])
    assert resolve_precision(cfg_auto, fixed, source="x.json", hardware=avx2).warning is not None
    fp32 = json.loads(Path("ds_configs/zero1_fp32_lamb.json").read_text())
    assert precision_of(resolve(fp32, cfg_auto, cuda=True)) == "fp32"  # disabled sections fix fp32
    del fp32["bf16"], fp32["fp16"]
    assert precision_of(resolve(fp32, cfg_auto, cuda=True)) == "bf16"  # no sections: auto


@pytest.mark.parametrize(
    "precision, ds_patch, cuda, message",
    [
        ("fp16", {}, False, "fp16, which DeepSpeed supports only on CUDA"),
        ("auto", {"fp16": {"enabled": True}, "bf16": {"enabled": False}}, False, "only on CUDA"),
        ("fp32", {"bf16": {"enabled": True}}, True, "train.precision=fp32 but x.json fixes bf16"),
        ("auto", {"bf16": {"enabled": "yes"}}, True, 'bf16.enabled must be true, false or "auto"'),
        ("auto", {"bfloat16": {"enabled": True}}, True, 'rename its "bfloat16" section to "bf16"'),
    ],
)
def test_precision_conflicts_name_the_keys(precision, ds_patch, cuda, message):
    cfg = load_config(None, [f"train.precision={precision}"])
    ds = {**json.loads(Path("ds_configs/zero1_lamb.json").read_text()), **ds_patch}
    with pytest.raises(ConfigError, match=message):
        resolve_precision(cfg, ds, source="x.json", hardware=Hardware(cuda, True, "a device"))


def test_unknown_precision_is_refused_at_load():
    with pytest.raises(ConfigError, match="train.precision must be one of"):
        load_config(None, ["train.precision=fp8"])


def test_cpu_bf16_detection_honours_the_kernel_caps(monkeypatch):
    from eva_fastclip.plan import precision

    monkeypatch.setattr(precision, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    for env, native in ((None, True), ("AVX2", False), ("avx512_core_amx", True)):
        precision.cpu_bf16_support.cache_clear()
        if env is None:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", env)
        assert precision.cpu_bf16_support()[0] is native, env
    monkeypatch.setattr(precision, "_cpu_flags", lambda: {"avx2", "fma"})
    precision.cpu_bf16_support.cache_clear()
    assert precision.cpu_bf16_support() == (False, "CPU (AVX2; no AVX-512 BF16 or AMX)")
    precision.cpu_bf16_support.cache_clear()


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
        "other.temperature": (1e-3, 0.0),
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


def test_batchnorm_towers_train_in_bf16(tmp_path):
    """DeepSpeed casts parameters, not buffers: BatchNorm's running statistics follow its weights."""
    from benchmarks.step_contestants import bench_trainer, synthetic_batch

    batch = synthetic_batch(4, (32, 32), 16, 49408)
    trainer = bench_trainer(
        "test-rn-xs", 0.0, 4, batch, str(tmp_path), "ds_configs/zero1_lamb.json", ("train.precision=bf16",)
    )
    norms = [m for m in trainer.engine.module.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(m.running_mean.dtype == m.weight.dtype == torch.bfloat16 for m in norms)
    before = norms[0].running_mean.clone()
    metrics = trainer.train_step(*batch)  # refused by the CPU kernel with fp32 statistics
    assert math.isfinite(metrics["loss"]) and not torch.equal(norms[0].running_mean, before)
    trainer.engine.destroy()


def test_ranks_on_one_machine_share_its_cores_and_a_rank_alone_keeps_its_threads(monkeypatch):
    """A rank alone keeps the threads its process chose (a Trainer in a test worker on 1 thread beside
    launched ranks: had it taken every core, its idle threads spun for them, 4x the CPU time for the same
    work); ranks sharing a machine split its cores."""
    from eva_fastclip.reliability.process import share_cores_among_ranks

    before = torch.get_num_threads()
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    try:
        torch.set_num_threads(1)
        share_cores_among_ranks()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launch.py: 2 ranks on this machine
        share_cores_among_ranks()
        assert torch.get_num_threads() == 4
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # torchrun's, first: more ranks than cores
        share_cores_among_ranks()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
