"""Resume anywhere, in one process: the data stream, the lr schedule and gamma's horizon continue as the
run would have; what a resumed run may change, and what it refuses. Killed runs resumed exactly and
checkpoints resumed on another number of ranks, with real ranks: tests/launched/test_resume_runs.py.
"""

import json
import logging
import math
import re
import shutil
from pathlib import Path

import open_clip
import pytest
import torch
from stand_ins import SixBatches, files_of, step_log
from torchvision import transforms

from eva_fastclip.checkpointing import checkpoint, resume_config
from eva_fastclip.cli import main
from eva_fastclip.config import ConfigError, load_config
from eva_fastclip.data import TrainLoader, write_shard
from eva_fastclip.engine.build import build_trainer
from eva_fastclip.export import consolidated_state_dict
from eva_fastclip.losses import build_loss
from eva_fastclip.optim.schedule import WarmupCosine, warmup_cosine
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

REPO = Path(__file__).parents[1]
MICRO = 8  # pairs a micro-batch


# ---- the data stream ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """40 samples in 8 shards; two of them hold an image that does not decode (index 7 and 23)."""
    from io import BytesIO

    from PIL import Image

    out = tmp_path_factory.mktemp("stream")
    for shard in range(8):
        samples = []
        for i in range(shard * 5, shard * 5 + 5):
            buffer = BytesIO()
            Image.new("RGB", (16, 16), (i * 6, 255 - i * 6, 100)).save(buffer, format="PNG")
            png = b"\x89PNG\r\n\x1a\n garbage" if i in (7, 23) else buffer.getvalue()
            samples.append({"__key__": f"s{i:03d}", "png": png, "txt": f"sample {i}", "json": {"key": i}})
        write_shard(out / f"shard-{shard:06d}.tar", samples)
    return out


def stream_loader(shards, rank=0, world=1, workers=2, resampled=False, buffer=6):
    crop = transforms.Compose([transforms.RandomResizedCrop(8, scale=(0.3, 1.0)), transforms.ToTensor()])
    return TrainLoader(
        [str(shards)],
        preprocess=crop,  # random: a resumed stream must crop as the uninterrupted one did
        tokenize=open_clip.get_tokenizer("ViT-B-32"),
        batch_size=3,
        rank=rank,
        world_size=world,
        seed=1,
        num_samples=60,  # more than the 38 good samples: the workers' streams go into their next pass
        index_size=40,
        resampled=resampled,
        shuffle_buffer=buffer,
        workers=workers,
    )


def batches_after(loader, epoch, stop=None):
    """Batches of ``epoch`` (from where the loader stands) as (images, indices); with ``stop``, stops after
    that many and returns them and the loader's state then."""
    out = []
    for images, _, indices, _ in loader:
        out.append((images, indices))
        if len(out) == stop:
            return out, loader.state_dict()
    return out


@pytest.mark.parametrize(
    "resampled, workers, world, buffer",
    [(False, 2, 2, 6), (False, 0, 1, 6), (False, 2, 1, 0), (True, 2, 2, 6), (True, 0, 1, 0)],
)
def test_a_resumed_epoch_goes_on_exactly_where_it_stopped(shards, resampled, workers, world, buffer):
    """Every rank's remaining batches (images with their random crops, and indices) are the uninterrupted
    epoch's, whichever batch it stopped after, and again after a second resume."""
    for rank in range(world):
        loader = stream_loader(shards, rank, world, workers, resampled, buffer)
        loader.set_epoch(1)
        full = batches_after(loader, 1)
        assert len(full) == loader.num_batches
        for stop in (1, workers + 1, len(full) - 1):
            first = stream_loader(shards, rank, world, workers, resampled, buffer)
            first.set_epoch(1)
            _, state = batches_after(first, 1, stop)
            second = stream_loader(shards, rank, world, workers, resampled, buffer)
            assert second.resume(1, stop, state)
            if stop + 2 < len(full):  # and from a resumed loader's position
                rest, state = batches_after(second, 1, 2)
                third = stream_loader(shards, rank, world, workers, resampled, buffer)
                assert third.resume(1, stop + 2, state)
                rest += batches_after(third, 1)
            else:
                rest = batches_after(second, 1)
            assert len(rest) == len(full) - stop
            for (images, indices), (want_images, want_indices) in zip(rest, full[stop:]):
                assert torch.equal(indices, want_indices) and torch.equal(images, want_images)


def test_a_position_from_another_layout_resumes_at_shard_granularity(shards):
    loader = stream_loader(shards, workers=2)
    loader.set_epoch(0)
    _, state = batches_after(loader, 0, 10)
    other = stream_loader(shards, workers=1)
    assert not other.resume(0, 10, state)  # another number of workers: approximately
    rest = batches_after(other, 0)
    assert len(rest) == other.num_batches - 10
    assert not stream_loader(shards).resume(0, 10, None)


# ---- schedule and gamma -----------------------------------------------------------------------------


@pytest.mark.parametrize("resume_at, new_total", [(20, 60), (3, 60), (20, 25), (30, 40)])
def test_a_changed_length_stretches_the_rest_of_the_decay(resume_at, new_total):
    schedule = WarmupCosine(warmup=5, total=30, min_ratio=0.1)
    for step in range(40):  # unchanged, it is warmup_cosine
        want = warmup_cosine(step, warmup=5, total=30, min_ratio=0.1)
        assert schedule(step) == pytest.approx(want, abs=1e-12)
    before = schedule(resume_at)
    schedule.retarget(resume_at, new_total)
    assert schedule(resume_at) == pytest.approx(before, abs=1e-12)  # the lr goes on from where it stood
    after = [schedule(step) for step in range(resume_at, new_total + 1)]
    assert after[-1] == pytest.approx(0.1)  # ends where the schedule ends, at the new length
    if resume_at >= 5:  # decaying, monotonically, by steps no larger than the original's steepest
        steps = [a - b for a, b in zip(after, after[1:])]
        assert all(-1e-12 <= d <= 0.9 * math.pi / 2 / min(25, new_total - resume_at) + 1e-12 for d in steps)
    schedule.retarget(resume_at, new_total)  # idempotent
    assert schedule(resume_at) == pytest.approx(before, abs=1e-12)


def test_gamma_horizon_is_never_assumed():
    loss = build_loss("fastclip_v3", dataset_size=8)
    assert loss.gamma() == 1.0  # the first epoch needs no horizon
    loss.set_epoch(1)
    with pytest.raises(ValueError, match="gamma_decay_epochs"):
        loss.gamma()
    loss = build_loss("fastclip_v3", dataset_size=8, gamma_decay_epochs=4)
    loss.set_epoch(2)
    assert loss.gamma() == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 4)) * 0.8 + 0.2)
    by_epochs = load_config(None, ["loss.name=fastclip_v3", "train.epochs=30"])
    by_steps = load_config(None, ["loss.name=fastclip_v3", "train.epochs=1", "train.steps=1000"])
    assert (by_epochs.loss.gamma_decay_epochs, by_steps.loss.gamma_decay_epochs) == (15, None)


def test_the_trainer_derives_gamma_horizon_from_steps(tmp_path):
    """train.steps=50 at 6 steps an epoch is 9 epochs: gamma decays over 4, not train.epochs's."""
    cfg = tiny_config(tmp_path, ["train.epochs=1", "train.steps=50"])
    trainer = build_trainer(cfg, load_deepspeed_config(cfg.train.deepspeed_config), loader=SixBatches())
    assert trainer.loss.cfg.gamma_decay_epochs == 4


def tiny_config(tmp_path, overrides):
    return load_config(
        "configs/toy.json",
        [
            "model.name=test-vit-xs",
            "loss.name=fastclip_v3",
            f"train.batch_size={MICRO}",
            f"train.output_dir={tmp_path}",
            "train.precision=fp32",
            "optim.warmup_steps=1",
            "eval.zeroshot_dir=null",
            "eval.retrieval_shards=null",
            *overrides,
        ],
    )


def test_another_rank_count_that_cannot_keep_the_global_batch_stops_before_step_1(tmp_path):
    folder = tmp_path / "checkpoints" / "step_00000003"
    folder.mkdir(parents=True)
    checkpoint.write_json_atomic(folder / checkpoint.MARKER, {"step": 3, "world_size": 2, "global_batch": 16})
    cfg = tiny_config(tmp_path, ["train.batch_size=5"])
    with pytest.raises(ConfigError, match="train.batch_size=4 and train.grad_accum_steps=4"):
        build_trainer(
            cfg, load_deepspeed_config(cfg.train.deepspeed_config), resume="latest", loader=SixBatches()
        )


# ---- what a resumed run may change ------------------------------------------------------------------

SIX_STEPS = ["train.steps=6", "train.save_every_steps=3", "optim.warmup_steps=2", "optim.min_lr_ratio=0.1"]


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A run of 6 steps (one rank, in this process) with its checkpoints of steps 3 and 6; tests copy it."""
    out = tmp_path_factory.mktemp("six_steps")
    cfg = tiny_config(out, SIX_STEPS)
    build_trainer(cfg, load_deepspeed_config(cfg.train.deepspeed_config), loader=SixBatches()).train()
    return out


def schedule(step: int, peak: float, min_ratio: float, warmup: int = 2, total: int = 6) -> float:
    """The lr after ``step`` optimizer steps: linear warm-up, then cosine to ``min_ratio`` x ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (
        min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) / 2
    )


def test_a_resumed_run_trains_with_the_optimizer_settings_it_is_given(six_steps, tmp_path, caplog):
    """Resumed from step 3 with optim.lr, optim.weight_decay, loss.temperature_lr and optim.min_lr_ratio
    changed: the log names each change, every group's weight decay is the new one and from step 4 on every
    lr is the new peak times the schedule (written out here); the run's own step-6 checkpoint replaces the
    one the first run left."""
    shutil.copytree(six_steps, tmp_path, dirs_exist_ok=True)
    first_run = consolidated_state_dict(tmp_path / "checkpoints" / "step_00000006")["visual.conv1.weight"]
    changed = [
        "optim.lr=1e-5",
        "optim.weight_decay=0.02",
        "loss.temperature_lr=5e-5",
        "optim.min_lr_ratio=0.3",
    ]
    cfg = tiny_config(tmp_path, [*SIX_STEPS, *changed])
    caplog.set_level(logging.INFO, logger="eva_fastclip")
    resume = str(tmp_path / "checkpoints" / "step_00000003")
    trainer = build_trainer(
        cfg, load_deepspeed_config(cfg.train.deepspeed_config), resume=resume, loader=SixBatches()
    )
    for line in (
        "optim.lr 0.001 -> 1e-05 on resume",
        "optim.weight_decay 0.1 -> 0.02 on resume",
        "loss.temperature_lr 0.0002 -> 5e-05 on resume",
        "optim.min_lr_ratio 0.1 -> 0.3 on resume",
    ):
        assert caplog.text.count(line) == 1, line
    for group in trainer.engine.optimizer.param_groups:
        assert group["weight_decay"] == (0.02 if group["name"].endswith(".decay") else 0.0), group["name"]
    trainer.train()
    log = step_log(tmp_path)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    for r in log:
        peak, min_ratio, tau_lr = (1e-3, 0.1, 2e-4) if r["step"] <= 3 else (1e-5, 0.3, 5e-5)
        want = schedule(r["step"], peak, min_ratio)
        assert r["lr/visual"] == pytest.approx(want, rel=1e-12), r
        assert r["lr/text"] == pytest.approx(want, rel=1e-12), r
        assert r["lr/temperature"] == pytest.approx(tau_lr, rel=1e-12)
    saved = consolidated_state_dict(tmp_path / "checkpoints" / "step_00000006")["visual.conv1.weight"]
    assert torch.equal(saved, trainer.engine.module.visual.conv1.weight) and not torch.equal(saved, first_run)
    assert checkpoint.resolve_resume("latest", tmp_path / "checkpoints").name == "step_00000006"


@pytest.mark.parametrize(
    "override, key, saved",
    [
        ("optim.warmup_steps=5", "optim.warmup_steps", "2"),
        ("model.name=toy-vit-t", "model.name", '"test-vit-xs"'),
        ("loss.name=fastclip_v1", "loss.name", '"fastclip_v3"'),
        ("train.deepspeed_config=ds_configs/zero1_adamw.json", "deepspeed.optimizer.type", '"Lamb"'),
        ("train.contrastive_batch=global", "train.contrastive_batch", '"micro"'),
    ],
)
def test_a_key_that_cannot_change_on_resume_stops_before_step_1(six_steps, tmp_path, override, key, saved):
    shutil.copytree(six_steps, tmp_path, dirs_exist_ok=True)
    before = files_of(tmp_path, mtimes=True)
    cfg = tiny_config(tmp_path, [*SIX_STEPS, override])
    with pytest.raises(ConfigError) as err:
        build_trainer(
            cfg, load_deepspeed_config(cfg.train.deepspeed_config), resume="latest", loader=SixBatches()
        )
    message = str(err.value)
    assert f"{key}: " in message and f"was trained with {key}={saved}" in message, message
    assert "cannot change on resume" in message and "start a new run in another train.output_dir" in message
    assert files_of(tmp_path, mtimes=True) == before


def test_the_dry_run_names_a_key_that_cannot_change_on_resume(six_steps, tmp_path, capsys):
    shutil.copytree(six_steps, tmp_path, dirs_exist_ok=True)
    sets = [*SIX_STEPS, "optim.warmup_steps=5", "model.name=test-vit-xs", "loss.name=fastclip_v3"]
    sets += [f"train.output_dir={tmp_path}", "eval.zeroshot_dir=null", "eval.retrieval_shards=null"]
    argv = ["train", "--config", "configs/toy.json", "--resume", "latest", "--dry-run"]
    assert main(argv + [arg for item in sets for arg in ("--set", item)]) == 2
    errors = json.loads(capsys.readouterr().out)["preflight"]["errors"]
    assert any(e.startswith("optim.warmup_steps: ") and "optim.warmup_steps=2" in e for e in errors), errors


def test_every_config_key_has_a_rule_on_resume():
    from eva_fastclip.config import ExperimentConfig

    flat = resume_config._flatten(ExperimentConfig().to_dict())
    assert sorted(flat.keys() - resume_config.RULES.keys()) == []


def test_what_a_resume_compares():
    saved = {
        "config": {
            "loss": {"name": "fastclip_v3", "gamma_decay_epochs": 3},
            "data": {"index_size": 100},
            "train": {"precision": "bf16", "seed": 0},
            "model": {"pretrained": "a.pt"},
        },
        "deepspeed": {"optimizer": {"type": "Lamb", "params": {"betas": [0.9, 0.98]}}},
    }

    def changes(config, deepspeed=None):
        new = {"config": config, "deepspeed": deepspeed or saved["deepspeed"]}
        return {change.key: change for change in resume_config.compare(saved, new)}

    same = {**saved["config"], "train": {"precision": "auto"}}  # decided elsewhere; seed: only one side
    assert changes({**same, "loss": {"name": "fastclip_v3", "gamma_decay_epochs": None}}) == {}  # derived
    assert changes({**same, "data": {"index_size": None}}) == {}  # read from the data, checked on load
    refused = changes({**same, "data": {"index_size": 200}})["data.index_size"]
    assert refused.refused and "data.index_size=100 and this run gives 200" in refused.refusal("ckpt")
    openclip = {**saved, "config": {**saved["config"], "loss": {"name": "openclip"}}}
    new = {"config": {**openclip["config"], "data": {"index_size": 200}}}
    assert not resume_config.compare(openclip, new)[0].refused  # no per-sample table
    betas = {"optimizer": {"type": "Lamb", "params": {"betas": (0.8, 0.9)}}}
    change = changes(same, betas)["deepspeed.optimizer.params.betas"]
    assert change.message() == "deepspeed.optimizer.params.betas [0.9, 0.98] -> [0.8, 0.9] on resume"
    start = changes({**same, "model": {"pretrained": "b.pt"}})["model.pretrained"]
    assert start.message().startswith('model.pretrained "a.pt" -> "b.pt" on resume (no effect: ')


def test_docs_list_every_key_that_cannot_change_or_is_read_at_the_start_only():
    text = (REPO / "docs" / "checkpoints.md").read_text()
    for label, kind in (("Cannot change", "fixed"), ("Read at a run's start only", "start")):
        item = text.split(f"- **{label}**", 1)[1].split("\n- ", 1)[0]
        named = set(re.findall(r"`([a-z_.]+)`", item)) & resume_config.RULES.keys()
        assert named == {key for key, rule in resume_config.RULES.items() if rule.kind == kind}, label


def test_reapplied_settings_follow_the_schedule_and_the_temperature_drop():
    """A load brings back the saved groups' settings and peaks; this run's come back in their place (the
    temperature's scaled by its one-time drop), each lr its new peak times the schedule where it stood."""

    def build(lr, weight_decay, tau_lr, betas):
        weights, tau = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(()))
        groups = [
            {"params": [weights], "name": "visual.decay", "weight_decay": weight_decay},
            {"params": [tau], "name": "temperature", "lr": tau_lr},
        ]
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=0.0)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, [WarmupCosine(2, 10, 0.1), lambda step: 1.0])

    saved = build(1e-3, 0.1, 2e-4, (0.9, 0.98))
    for _ in range(4):
        saved.optimizer.step()
        saved.step()
    scheduler = build(1e-5, 0.02, 5e-5, (0.8, 0.9))
    built = resume_config.optimizer_settings(scheduler)
    scheduler.optimizer.load_state_dict(saved.optimizer.state_dict())
    scheduler.load_state_dict(saved.state_dict())
    visual, tau = scheduler.optimizer.param_groups
    # what a load does: the checkpoint's settings and peak
    assert (visual["weight_decay"], visual["betas"], scheduler.base_lrs[0]) == (0.1, (0.9, 0.98), 1e-3)
    resume_config.reapply_optimizer_settings(scheduler, built, {"temperature": 1 / 3})
    assert (visual["weight_decay"], visual["betas"], tau["betas"]) == (0.02, (0.8, 0.9), (0.8, 0.9))
    assert visual["lr"] == pytest.approx(schedule(4, 1e-5, 0.1, total=10), rel=1e-12)
    assert tau["lr"] == pytest.approx(5e-5 / 3, rel=1e-12)
    scheduler.optimizer.step()
    scheduler.step()
    assert visual["lr"] == pytest.approx(schedule(5, 1e-5, 0.1, total=10), rel=1e-12)
    assert tau["lr"] == pytest.approx(5e-5 / 3, rel=1e-12)


def test_a_run_without_resume_never_touches_an_earlier_run(six_steps, tmp_path, capsys):
    """A restart that forgets --resume, in a folder with complete checkpoints and a step log: stopped before
    step 1, by the Trainer and by --dry-run, naming --resume latest and how to start over; every file of the
    earlier run keeps its bytes and its modification time."""
    shutil.copytree(six_steps, tmp_path, dirs_exist_ok=True)
    assert (tmp_path / "train_log.jsonl").is_file() and checkpoint.complete_checkpoints(
        tmp_path / "checkpoints"
    )
    before = files_of(tmp_path, mtimes=True)
    cfg = tiny_config(tmp_path, SIX_STEPS)
    with pytest.raises(ConfigError) as err:
        build_trainer(cfg, load_deepspeed_config(cfg.train.deepspeed_config), loader=SixBatches())
    message = str(err.value)
    assert "--resume: " in message and "Continue it with --resume latest" in message
    assert "choose another train.output_dir" in message and f"delete {tmp_path / 'checkpoints'}" in message
    sets = [*SIX_STEPS, "model.name=test-vit-xs", f"train.output_dir={tmp_path}"]
    assert (
        main(["train", "--config", "configs/toy.json", "--dry-run", *[a for s in sets for a in ("--set", s)]])
        == 2
    )
    assert any("--resume latest" in e for e in json.loads(capsys.readouterr().out)["preflight"]["errors"])
    assert files_of(tmp_path, mtimes=True) == before
    # with --resume latest the finished run only evaluates (launchers/demo.sh run again): nothing is saved
    checkpoints = files_of(tmp_path / "checkpoints", mtimes=True)
    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    trainer = build_trainer(cfg, ds, resume="latest", loader=SixBatches())
    trainer.train()
    assert trainer.step == 6 and files_of(tmp_path / "checkpoints", mtimes=True) == checkpoints


def test_a_conversion_is_made_once_per_save(tmp_path, monkeypatch):
    import deepspeed.checkpoint.ds_to_universal as converter

    cfg = tiny_config(tmp_path, ["train.steps=1"])
    trainer = build_trainer(cfg, load_deepspeed_config(cfg.train.deepspeed_config), loader=SixBatches())
    trainer.train()  # one step: the optimizer has moments to convert
    folder = tmp_path / "checkpoints" / "step_00000001"
    assert not checkpoint.needs_conversion(folder, 1) and checkpoint.needs_conversion(folder, 2)
    universal = checkpoint.convert_to_universal(folder)
    assert universal == checkpoint.universal_folder(folder) and checkpoint.is_complete(universal)
    assert (universal / "zero" / "visual.conv1.weight" / "exp_avg.pt").is_file()
    assert not (folder.parent / "latest_universal").exists()
    calls = []
    real = converter.main
    monkeypatch.setattr(converter, "main", lambda args: (calls.append(args), real(args)))
    assert checkpoint.convert_to_universal(folder) == universal and not calls  # reused
    trainer.save()  # the same step saved again: the conversion is stale and goes
    assert not universal.exists()
    checkpoint.convert_to_universal(folder)
    assert len(calls) == 1 and checkpoint.is_complete(universal)
