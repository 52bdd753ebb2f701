"""Gradient accumulation and ZeRO stage 2 with a compositional loss, through the real DeepSpeed engine (fp32):
the per-sample state of every micro-batch is committed together at the optimizer step, and ZeRO-2
(gradients partitioned) takes exactly the step that ZeRO-1 takes. Which layouts of the same global batch take
the same step (docs/losses.md, Gradient accumulation): the micro-batches of a step in either order, and 2
ranks x 4 pairs x 2 micro-batches against 1 rank x 8 x 2 (tests/launched/test_accumulation_two_ranks.py);
and which do not: 1 rank x 2 micro-batches of 4 against 1 micro-batch of 8 (the step of 2 ranks x 1
micro-batch of 4)."""

import json
import math
from pathlib import Path

import accumulation_ranks as layouts
import pytest
import torch

from eva_fastclip.config import load_config
from eva_fastclip.engine.build import build_trainer

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
    return build_trainer(cfg, ds, loader=TwoMicroBatches())


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


def test_the_logged_loss_is_the_mean_over_the_steps_micro_batches(tmp_path):
    trainer = make_trainer(tmp_path, 1)
    loss, losses = trainer.loss, []

    class Recording:  # the loss, noting each micro-batch's value
        def __getattr__(self, name):
            return getattr(loss, name)

        def __call__(self, *args):
            out = loss(*args)
            losses.append(out.loss.item())
            return out

    trainer.contrastive_step.loss = Recording()
    first, second = trainer.loader.batches
    assert trainer.train_step(*first) is None
    metrics = trainer.train_step(*second)
    trainer.contrastive_step.loss = loss
    assert len(losses) == 2 and abs(losses[0] - losses[1]) > 1e-3  # the last one alone would differ
    assert metrics["loss"] == pytest.approx((losses[0] + losses[1]) / 2, rel=1e-6)


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


# ---- which layouts take the same step ----------------------------------------------------------------


def test_the_order_of_the_micro_batches_does_not_change_the_step(tmp_path, caplog):
    """Every micro-batch of a step reads the state committed before it and the same weights and tau: its
    micro-batches in the other order take the same step (fastclip_v2: u and the individual tau_i). The
    start-up log states the layout."""
    steps = layouts.step_pairs()
    with caplog.at_level("INFO", logger="eva_fastclip"):
        trainer = layouts.make_trainer(tmp_path / "a", "fastclip_v2", layouts.POOL)
    assert (
        "batch: global batch 16 = 1 rank(s) x 16 pairs (2 micro-batch(es) of 8 accumulated); each loss "
        "evaluation sees 8 pairs (the contrastive batch: micro-batch x ranks: train.contrastive_batch=micro)"
        in caplog.text
    )
    forward = layouts.run(trainer, steps)
    backward = layouts.run(
        layouts.make_trainer(tmp_path / "b", "fastclip_v2", layouts.POOL), steps, order=(1, 0)
    )
    layouts.assert_same_step(backward, forward)


def test_another_contrastive_batch_is_another_step(tmp_path):
    """The same 16 pairs per step as 2 micro-batches of 4 (each loss evaluation sees 4 pairs) and as 1
    micro-batch of 8 (sees 8: the step of 2 ranks x 1 micro-batch of 4, by
    launched/test_accumulation_two_ranks.py and launched/test_compositional_distributed.py): other
    negatives, another step."""
    steps = [pairs[:1] for pairs in layouts.step_pairs()]  # one micro-batch of 8 pairs a step

    def halves(pairs):
        images, tokens, indices = pairs[0]
        return [(images[:4], tokens[:4], indices[:4]), (images[4:], tokens[4:], indices[4:])]

    split = layouts.run(
        layouts.make_trainer(tmp_path / "a", "fastclip_v3", 4, accum=2), steps, micro_batches=halves
    )
    whole = layouts.run(layouts.make_trainer(tmp_path / "b", "fastclip_v3", 8, accum=1), steps, order=(0,))
    touched = torch.isfinite(whole["table"][:, 0])
    assert torch.equal(touched, torch.isfinite(split["table"][:, 0]))  # the same samples, other u
    assert (whole["table"][touched] - split["table"][touched]).abs().max() > 1e-3
    moved = max((whole["weights"][k] - split["weights"][k]).abs().max().item() for k in whole["weights"])
    assert moved > 1e-4
