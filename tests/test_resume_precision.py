"""A run resumed where `train.precision: auto` would choose another precision (a bf16 checkpoint moved to
an AVX2-only CPU) goes on in the precision it was trained in: DeepSpeed's optimizer files differ by
precision. An explicit choice that differs stops before step 1. One rank, in this process."""

import pytest
from stand_ins import StandInBatches, toy_config, toy_trainer

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.config import ConfigError
from eva_fastclip.engine import build as build_module
from eva_fastclip.engine.setup import precision_of
from eva_fastclip.plan.precision import Hardware


def make_trainer(tmp_path, precision, resume=None, steps=2):
    cfg = toy_config(
        tmp_path,
        "loss.name=fastclip_v3",
        "train.batch_size=8",
        f"train.steps={steps}",
        f"train.precision={precision}",
        "optim.warmup_steps=1",
    )
    return toy_trainer(cfg, loader=StandInBatches(6, 8), resume=resume)


def test_resume_keeps_the_checkpoint_precision(tmp_path, monkeypatch):
    first = make_trainer(tmp_path, "bf16")
    first.train()
    folder = checkpoint.resolve_resume("latest", tmp_path / "checkpoints")
    assert (
        checkpoint.saved_precision(folder) == "bf16" and checkpoint.read_marker(folder)["precision"] == "bf16"
    )

    avx2 = Hardware(cuda=False, native_bf16=False, description="CPU (AVX2)")
    monkeypatch.setattr(build_module, "detect_hardware", lambda: avx2)
    with pytest.raises(ConfigError, match="was trained in bf16, but this run asks for fp32"):
        make_trainer(tmp_path, "fp32", resume="latest", steps=3)
    resumed = make_trainer(tmp_path, "auto", resume="latest", steps=3)  # auto here alone would be fp32
    assert precision_of(resumed.engine) == "bf16" and resumed.step == 2
    resumed.train()
    assert resumed.step == 3
