"""Non-finite steps through ``eva-fastclip train`` (one rank, in this process): NaN images from chosen steps
on. What happens to them differs: ZeRO-1 skips the step (non-finite gradient norm), and so does ZeRO-0,
where our optimizer guards the step itself (optim/step_guard.py); DeepSpeed's bf16 without its overflow
check (``bf16.check_grad_overflow: false``) applies it and the weights turn NaN. Either way
``train.max_skipped_steps`` steps in a row stop the run with exit code 3 and a message that names the step
and the last complete checkpoint; no checkpoint is written from non-finite weights; the last complete one
loads and the run resumes from it.
On 2 ranks, where one rank's loss alone turns non-finite: tests/launched/test_nonfinite_two_ranks.py."""

import json
import logging
from pathlib import Path

import pytest
import torch
from launching import train_args
from stand_ins import complete_steps

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.cli import main
from eva_fastclip.config import ConfigError, load_config
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.engine import trainer as trainer_module

DATASET, BATCH = 64, 8


class Batches:
    """Stands in for the webdataset loader: the same seeded batches every epoch; the optimizer steps
    (1-based, counted over epochs) in ``poisoned`` get a NaN image."""

    def __init__(self, poisoned=()):
        g = torch.Generator().manual_seed(0)
        order = torch.randperm(DATASET, generator=g)
        self.batches = [
            (
                torch.randn(BATCH, 3, 32, 32, generator=g),
                torch.randint(1, 49000, (BATCH, 16), generator=g),
                order[i * BATCH : (i + 1) * BATCH],
            )
            for i in range(DATASET // BATCH)
        ]
        self.num_batches, self.dataset_size, self.num_samples = len(self.batches), DATASET, DATASET
        self.poisoned, self.drawn = set(poisoned), 0

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        for images, tokens, indices in self.batches:
            self.drawn += 1
            if self.drawn in self.poisoned:
                images = images.clone()
                images[0] = float("nan")  # -> non-finite features, loss and gradients
            yield images, tokens, indices


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Real shards for the checks before step 1 (the run itself reads Batches)."""
    out = tmp_path_factory.mktemp("toy")
    write_toy_dataset(out, num_train=DATASET, num_val=8, num_zeroshot=20, image_size=32, samples_per_shard=32)
    return out / "train"


def train(
    tmp_path,
    shards,
    monkeypatch,
    *,
    stage,
    poisoned,
    save_every,
    max_skipped=3,
    resume=None,
    model="test-vit-xs",
    precision="fp32",
):
    monkeypatch.setattr(trainer_module.TrainLoader, "for_run", lambda *args, **kwargs: Batches(poisoned))
    ds = json.loads(Path("ds_configs/zero1_fp32_lamb.json").read_text())
    ds["zero_optimization"]["stage"] = stage
    if precision == "bf16":  # DeepSpeed's bf16 without its overflow check: a NaN step is applied
        ds.pop("fp16")
        ds["bf16"] = {"enabled": True, "check_grad_overflow": False}
    ds_path = tmp_path / f"zero{stage}_{precision}.json"
    ds_path.write_text(json.dumps(ds))
    overrides = {
        "model.name": model,
        "loss.name": "fastclip_v3",
        "data.train_shards": json.dumps([str(shards)]),
        "train.deepspeed_config": str(ds_path),
        "train.precision": precision,
        "train.batch_size": BATCH,
        "train.steps": 12,
        "train.save_every_steps": save_every,
        "train.keep_checkpoints": 2,
        "train.max_skipped_steps": max_skipped,
        "train.output_dir": str(tmp_path / "run"),
        "optim.warmup_steps": 1,
        "eval.zeroshot_dir": "null",
        "eval.retrieval_shards": "null",
    }
    argv = train_args(*(f"{key}={value}" for key, value in overrides.items()))
    return main(argv + (["--resume", resume] if resume else []))


def weights_of(folder: Path) -> dict[str, torch.Tensor]:
    (states,) = folder.glob("mp_rank_00_model_states.pt")
    return torch.load(states, map_location="cpu", weights_only=False)["module"]


@pytest.mark.parametrize(
    "stage, precision, poisoned, save_every, stop_step, why, last",
    [
        # ZeRO-1 skips the NaN steps; the first streak (2) is below the limit and is forgotten
        (1, "fp32", {3, 4, 7, 8, 9}, 2, 9, "3 optimizer steps in a row (steps 7-9) were skipped", 8),
        # ZeRO-0: our optimizer's guard skips them the same way
        (0, "fp32", {3, 4, 7, 8, 9}, 2, 9, "3 optimizer steps in a row (steps 7-9) were skipped", 8),
        # unchecked bf16 applies the NaN step, the weights turn NaN: the save at step 6 is refused
        (1, "bf16", {5}, 2, 6, "the weights are no longer finite after 2 non-finite step(s) in a row", 4),
        # ... and with no save in between, the non-finite losses that follow are counted to the limit
        (1, "bf16", {5}, 4, 7, "3 optimizer steps in a row (steps 5-7) were skipped", 4),
    ],
    ids=["zero1-skipped", "zero0-skipped", "unchecked-applied-save-refused", "unchecked-applied-counted"],
)
def test_non_finite_steps_stop_the_run_and_keep_the_last_checkpoint(
    tmp_path,
    shards,
    monkeypatch,
    capsys,
    caplog,
    stage,
    precision,
    poisoned,
    save_every,
    stop_step,
    why,
    last,
):
    common = dict(stage=stage, save_every=save_every, precision=precision)
    assert train(tmp_path, shards, monkeypatch, poisoned=poisoned, **common) == 3
    err = capsys.readouterr().err
    last_folder = tmp_path / "run/checkpoints" / checkpoint.tag_for_step(last)
    assert f"eva-fastclip train: stopped: step {stop_step}: " in err and why in err
    assert f"the last complete checkpoint, {last_folder}, is intact" in err and "--resume latest" in err
    # nothing was saved after the last good checkpoint, not even a partial folder
    assert complete_steps(tmp_path / "run")[-1] == last
    assert max(int(p.name[5:]) for p in (tmp_path / "run/checkpoints").glob("step_*")) == last
    marker = json.loads((last_folder / checkpoint.MARKER).read_text())
    assert marker["step"] == last
    assert all(torch.isfinite(t).all() for t in weights_of(last_folder).values() if t.is_floating_point())

    # the last complete checkpoint loads, and the run resumes from it to its end
    caplog.set_level(logging.INFO, logger="eva_fastclip")
    assert train(tmp_path, shards, monkeypatch, poisoned=(), resume="latest", **common) == 0
    assert f"resumed from {last_folder} at step {last}" in caplog.text
    assert complete_steps(tmp_path / "run")[-1] == 12
    final = weights_of(tmp_path / "run/checkpoints" / checkpoint.tag_for_step(12))
    assert all(torch.isfinite(t).all() for t in final.values() if t.is_floating_point())


def test_zero_never_stops(tmp_path, shards, monkeypatch):
    """train.max_skipped_steps=0: ten skipped steps in a row, and the run ends with its final save (the
    skipped steps left the weights finite)."""
    poisoned = set(range(3, 13))
    assert train(tmp_path, shards, monkeypatch, stage=1, poisoned=poisoned, save_every=0, max_skipped=0) == 0
    assert complete_steps(tmp_path / "run") == [12]


def test_a_skipped_step_leaves_batchnorm_statistics_as_they_were(tmp_path, shards, monkeypatch):
    """A ResNet tower's BatchNorm updates its running statistics in the forward pass, also from the NaN
    batch of a step that is then skipped; NaN would stay there for good (and rank 0's are saved, so the run
    went on and saved NaN statistics without a word). The skipped step is undone there too."""
    assert train(tmp_path, shards, monkeypatch, stage=1, poisoned={3}, save_every=0, model="test-rn-xs") == 0
    final = weights_of(tmp_path / "run/checkpoints" / checkpoint.tag_for_step(12))
    stats = {k: t for k, t in final.items() if k.endswith(("running_mean", "running_var"))}
    assert stats and all(torch.isfinite(t).all() for t in stats.values())
    # 12 optimizer steps drew 12 batches, 11 of them counted: the skipped one's count was undone too
    (tracked,) = {int(t) for k, t in final.items() if k.endswith("num_batches_tracked")}
    assert tracked == 11


def test_max_skipped_steps_is_validated():
    assert load_config(None, []).train.max_skipped_steps == 20
    with pytest.raises(ConfigError, match=r"train\.max_skipped_steps must be >= 0"):
        load_config(None, ["train.max_skipped_steps=-1"])
