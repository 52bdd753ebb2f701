"""Gradient accumulation and ZeRO stage 2 with a compositional loss, through the real DeepSpeed engine (one
rank, fp32): the per-sample state of every micro-batch is committed together at the optimizer step, and
ZeRO-2 (gradients partitioned) takes exactly the step that ZeRO-1 takes."""

import json
import math
from pathlib import Path

import pytest
import torch

from eva_fastclip.config import load_config
from eva_fastclip.engine.trainer import Trainer

BATCH, DATASET = 8, 32


class TwoMicroBatches:
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        order = torch.randperm(DATASET, generator=g)
        self.batches = [
            (
                torch.randn(BATCH, 3, 32, 32, generator=g),
                torch.randint(1, 49000, (BATCH, 16), generator=g),
                order[i * BATCH : (i + 1) * BATCH],
            )
            for i in range(2)
        ]
        self.num_batches, self.dataset_size, self.num_samples = 2, DATASET, DATASET

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        return iter(self.batches)


def make_trainer(tmp_path, stage):
    ds = json.loads(Path("ds_configs/zero1_fp32_lamb.json").read_text())
    ds["zero_optimization"]["stage"] = stage
    cfg = load_config(
        "configs/toy.json",
        [
            "model.name=test-vit-xs",
            "loss.name=fastclip_v3",
            f"train.batch_size={BATCH}",
            "train.grad_accum_steps=2",
            "train.steps=1",
            f"train.output_dir={tmp_path / f'stage{stage}'}",
            "optim.warmup_steps=0",
            "eval.zeroshot_dir=null",
            "eval.retrieval_shards=null",
        ],
    )
    return Trainer(cfg, ds, loader=TwoMicroBatches())


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accumulation")
    out = {}
    for stage in (1, 2):
        trainer = make_trainer(tmp, stage)
        first, second = trainer.loader.batches
        before = {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}
        assert trainer.train_step(*first) is None  # accumulating: no optimizer step, nothing committed
        table_mid = trainer.loss.state.values.clone()
        metrics = trainer.train_step(*second)
        out[stage] = {
            "trainer": trainer,
            "before": before,
            "table_mid": table_mid,
            "metrics": metrics,
            "indices": torch.cat([first[2], second[2]]),
        }
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_state_of_all_micro_batches_is_committed_at_the_step(stepped, stage):
    run = stepped[stage]
    trainer = run["trainer"]
    assert run["metrics"]["step_applied"] == 1.0
    assert torch.isinf(run["table_mid"][:, 0]).all()  # after micro-batch 1 of 2 the table is untouched
    log_u1 = trainer.loss.state.values[:, trainer.loss.state.column("log_u1")]
    touched = torch.zeros(DATASET, dtype=torch.bool)
    touched[run["indices"]] = True
    assert torch.isfinite(log_u1[touched]).all() and torch.isinf(log_u1[~touched]).all()
    weights = trainer.engine.module.state_dict()
    assert not torch.equal(weights["visual.conv1.weight"], run["before"]["visual.conv1.weight"])


def test_zero2_takes_the_same_step_as_zero1(stepped):
    one, two = stepped[1]["trainer"], stepped[2]["trainer"]
    assert (one.engine.zero_optimization_stage(), two.engine.zero_optimization_stage()) == (1, 2)
    for (name, a), (_, b) in zip(
        one.engine.module.state_dict().items(), two.engine.module.state_dict().items()
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(one.loss.state.values, two.loss.state.values)
    assert math.isclose(stepped[1]["metrics"]["loss"], stepped[2]["metrics"]["loss"], rel_tol=1e-6)
