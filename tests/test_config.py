import json
from pathlib import Path

import pytest

from eva_fastclip.config import ConfigError, ExperimentConfig, load_config
from eva_fastclip.plan.layout import BatchLayout, batch_layout


def write(tmp_path, payload):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(payload))
    return path


def test_defaults_and_overrides(tmp_path):
    path = write(tmp_path, {"train": {"batch_size": 32}, "optim": {"lr": 2}})
    cfg = load_config(
        path, ["train.grad_accum_steps=4", "model.name=ViT-B-16", 'data.train_shards=["a","b"]']
    )
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.train.batch_size == 32 and cfg.train.grad_accum_steps == 4
    assert cfg.optim.lr == 2.0 and isinstance(cfg.optim.lr, float)  # ints are accepted where floats are asked
    assert cfg.model.name == "ViT-B-16"  # a bare string needs no JSON quotes on the command line
    assert cfg.data.train_shards == ["a", "b"]


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"train": {"batch_sise": 3}}, "'train.batch_sise' (did you mean 'train.batch_size'?)"),
        ({"nonsense": {}}, "unknown config key 'nonsense'"),
        ({"train": {"batch_size": "64"}}, "'train.batch_size' must be int"),
        ({"train": {"batch_size": True}}, "'train.batch_size' must be int"),
        ({"train": {"batch_size": 0}}, "train.batch_size must be > 0"),
        ({"data": {"train_shards": "x"}}, "'data.train_shards' must be a list"),
        ({"data": {"train_shards": [1]}}, "'data.train_shards[0]' must be str"),
        ({"model": {"patch_dropout": 1.5}}, "model.patch_dropout must be in [0, 1)"),
        ({"model": {"pretrained": "laion2b_s34b_b88k"}}, "never downloads"),
        ({"loss": {"name": "nope"}}, "loss.name='nope' is unknown"),
        ({"data": {"train_weights": [1.0, 2.0]}}, "one weight per source"),
        ({"data": {"train_shards": ["a"], "train_weights": [1.0]}}, "needs data.resampled=true"),
        ({"train": []}, "train must be a JSON object"),
        ({"loss": {"name": "fastclip_v3", "temperature_rule": "individual_adam"}}, "does not fit loss.name"),
        ({"loss": {"name": "fastclip_v2", "temperature_rule": "rgcl_g"}}, "does not fit loss.name"),
        ({"loss": {"name": "fastclip_v1", "temperature_init": 2.0}}, "must lie in [loss.temperature_min"),
        ({"loss": {"name": "sogclr", "gamma_min": 0.0}}, "loss.gamma_min must be in (0, 1]"),
        ({"loss": {"name": "fastclip_v1", "gamma_schedule": "linear"}}, "cosine or constant"),
        (
            {"loss": {"name": "isogclr", "temperature_momentum": 1.0}},
            "temperature_momentum must be in [0, 1)",
        ),
        ({"optim": {"lr": float("nan")}}, "'optim.lr' must be a finite number, got nan"),
        ({"loss": {"name": "fastclip_v3", "rho": float("inf")}}, "'loss.rho' must be a finite number"),
        ({"optim": {"min_lr_ratio": float("-inf")}}, "'optim.min_lr_ratio' must be a finite number"),
        (
            {"loss": {"name": "isogclr", "temperature_grad_clip": -1}},
            "loss.temperature_grad_clip must be > 0",
        ),
        ({"loss": {"name": "fastclip_v3", "temperature_lr_drop_factor": -3}}, "must be in (0, 1]"),
        ({"loss": {"name": "fastclip_v3", "temperature_lr_drop_below": 0}}, "drop_below must be > 0"),
        ({"train": {"peak_tflops": 0}}, "train.peak_tflops must be > 0, got 0"),
        ({"train": {"peak_tflops": -312.0}}, "train.peak_tflops must be > 0"),
        ({"train": {"peak_tflops": "989"}}, "'train.peak_tflops' must be float"),
        ({"train": {"peak_tflops": float("inf")}}, "'train.peak_tflops' must be a finite number"),
    ],
)
def test_rejects_bad_values_naming_the_key(tmp_path, payload, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, payload))
    assert message in str(err.value)


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(None, ["train.batch_size"])


def test_loss_defaults_follow_the_variant():
    v3 = load_config(None, ["loss.name=fastclip_v3", "train.epochs=30"]).loss
    assert (v3.temperature_rule, v3.rho, v3.temperature_lr, v3.gamma_decay_epochs) == (
        "rgcl_g",
        6.5,
        2e-4,
        15,
    )
    v2 = load_config(None, ["loss.name=fastclip_v2", "loss.rho=9"]).loss
    assert (v2.temperature_rule, v2.temperature_init, v2.rho) == ("individual_adam", 0.03, 9.0)
    sog = load_config(None, ["loss.name=sogclr"]).loss
    assert (sog.gamma_schedule, sog.gamma_min, sog.eps) == ("constant", 0.9, 1e-14)


def test_batch_layout():
    layout = BatchLayout(micro_batch=16, grad_accum_steps=4, world_size=8)
    assert layout.global_batch == 512
    assert layout.samples_per_forward == 128


@pytest.mark.parametrize(
    "ranks, max_micro, micro, accum",
    [
        (32, 320, 160, 1),  # the share fits: no accumulation
        (16, 320, 320, 1),
        (8, 320, 320, 2),  # 640 a rank in 2 micro-batches of 320
        (4, 320, 320, 4),
        (4, 300, 256, 5),  # 1280 = 5 x 256: the largest divisor within 300
        (4, None, 1280, 1),  # no bound: the whole share in one forward pass
        (1, 1000, 640, 8),
    ],
)
def test_the_global_batch_is_the_same_on_any_number_of_ranks(ranks, max_micro, micro, accum):
    cfg = load_config(None, ["train.global_batch=5120", f"train.max_micro_batch={json.dumps(max_micro)}"])
    layout = batch_layout(cfg, ranks)
    assert (layout.micro_batch, layout.grad_accum_steps, layout.world_size) == (micro, accum, ranks)
    assert layout.global_batch == 5120 and layout.per_rank == 5120 // ranks
    assert layout.samples_per_forward == micro * ranks == layout.contrastive_batch  # micro: one forward's
    assert layout.summary()["contrastive_batch"] == micro * ranks
    assert f"global batch 5120 = {ranks} rank(s) x {5120 // ranks} pairs" in layout.describe()
    # the reference (a preset's global batch) trained all 5120 pairs in one loss evaluation
    shrank = [w for w in layout.warnings() if "contrastive batch shrank" in w]
    assert bool(shrank) == (accum > 1)
    if accum > 1:
        assert f"shrank to {micro * ranks} pairs from the reference's 5120" in shrank[0]
        assert "train.contrastive_batch=global" in shrank[0]
        assert (
            f"sees {micro * ranks} pairs" in layout.describe()
            and "the reference's: 5120" in layout.describe()
        )
    # global: every loss evaluation sees the whole step, on any number of ranks, and nothing shrank
    cfg = load_config(None, [*_global(5120, max_micro), "train.contrastive_batch=global"])
    layout = batch_layout(cfg, ranks)
    assert (layout.micro_batch, layout.grad_accum_steps) == (micro, accum)
    assert layout.contrastive_batch == layout.summary()["contrastive_batch"] == 5120
    assert "sees 5120 pairs (the contrastive batch: the whole step's pairs" in layout.describe()
    assert "the reference's)" in layout.describe()
    assert not [w for w in layout.warnings() if "contrastive batch" in w]


def _global(batch, max_micro):
    return [f"train.global_batch={batch}", f"train.max_micro_batch={json.dumps(max_micro)}"]


def test_many_micro_batches_are_a_warning():
    cfg = load_config(None, ["train.global_batch=4096", "train.max_micro_batch=16"])
    layout = batch_layout(cfg, 8)  # 512 a rank: 32 micro-batches of 16
    assert (layout.micro_batch, layout.grad_accum_steps) == (16, 32)
    (many,) = [w for w in layout.warnings() if "32 micro-batches accumulated" in w]
    assert "128 of the global batch's 4096" in many
    cfg = load_config(
        None, ["train.global_batch=4096", "train.max_micro_batch=16", "train.contrastive_batch=global"]
    )
    (many,) = batch_layout(cfg, 8).warnings()  # still 32 forward passes a step, but all 4096 negatives
    assert "32 micro-batches accumulated" in many and "negatives" not in many


def test_per_rank_batches_state_no_reference():
    """Without train.global_batch the batch grows with the ranks: there is no reference to compare with."""
    layout = batch_layout(load_config(None, ["train.batch_size=8", "train.grad_accum_steps=4"]), 2)
    assert layout.contrastive_batch == 16 and layout.reference_contrastive_batch is None
    assert layout.warnings() == [] and "reference" not in layout.describe()
    cfg = load_config(
        None, ["train.batch_size=8", "train.grad_accum_steps=4", "train.contrastive_batch=global"]
    )
    assert batch_layout(cfg, 2).contrastive_batch == 64


def test_an_unknown_contrastive_batch_is_refused():
    with pytest.raises(ConfigError, match="train.contrastive_batch must be one of"):
        load_config(None, ["train.contrastive_batch=all"])


@pytest.mark.parametrize(
    "sets, ranks, message",
    [
        (["train.global_batch=5120"], 7, "train.global_batch=5120 does not divide over 7 ranks"),
        (["train.global_batch=5120"], 7, "run on 5 or 8 ranks"),
        (["train.global_batch=5120"], 7, "e.g. 5117 or 5124"),
        # 1021 a rank is prime: micro-batches of 1, 1021 forward passes a step where 2 would do
        (["train.global_batch=2042", "train.max_micro_batch=512"], 2, "largest micro-batch dividing 1021"),
        (["train.global_batch=2042", "train.max_micro_batch=512"], 2, "e.g. 2040 (2 micro-batches of 510"),
    ],
)
def test_a_global_batch_that_cannot_be_made_is_refused(sets, ranks, message):
    cfg = load_config(None, sets)
    with pytest.raises(ConfigError) as err:
        batch_layout(cfg, ranks)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.global_batch=512", "train.batch_size=32"], "train.batch_size=32 and train.global_batch=512"),
        (["train.global_batch=512", "train.grad_accum_steps=2"], "train.grad_accum_steps=2 and train.global"),
        (["train.global_batch=512", "train.batch_size=32"], "set train.max_micro_batch"),
        (["train.max_micro_batch=32"], "train.max_micro_batch=32 bounds the micro-batch derived from"),
        (["train.global_batch=0"], "train.global_batch must be > 0"),
        (["train.global_batch=64", "train.max_micro_batch=0"], "train.max_micro_batch must be > 0"),
    ],
)
def test_batch_keys_that_conflict_are_refused_naming_both(sets, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets)
    assert message in str(err.value)


def test_per_rank_batch_without_a_global_batch():
    """The toy configs' and tests' way: the batch per rank, the global batch growing with the ranks; a
    preset's batch keys can be switched back to it from the command line."""
    cfg = load_config(None, [])
    assert (cfg.train.batch_size, cfg.train.grad_accum_steps, cfg.train.global_batch) == (64, 1, None)
    assert batch_layout(cfg, 4).global_batch == 256
    preset = load_config(
        "configs/laion_vitb16_fastclip_v3.json",
        ["train.global_batch=null", "train.max_micro_batch=null", "train.batch_size=32"],
    )
    assert batch_layout(preset, 4).global_batch == 128
    # a run resumed on another number of ranks keeps its checkpoint's global batch by accumulating
    cfg = load_config(None, ["train.batch_size=8", "train.grad_accum_steps=2"])
    kept = batch_layout(cfg, 2, resumed_global=64)  # saved by 4 ranks x 8 x 2
    assert (kept.micro_batch, kept.grad_accum_steps, kept.global_batch) == (8, 4, 64)
    with pytest.raises(ConfigError, match="set train.batch_size=6 and train.grad_accum_steps=2"):
        batch_layout(load_config(None, ["train.batch_size=8"]), 4, resumed_global=48)
    # with train.global_batch the config's global batch wins: the layout is derived as at a start
    cfg = load_config(None, ["train.global_batch=64"])
    assert batch_layout(cfg, 2, resumed_global=128).global_batch == 64


def test_a_resume_on_another_number_of_ranks_keeps_the_global_batch(tmp_path):
    """The plan of a run resumed on 2 ranks from a checkpoint of 4: without train.global_batch the
    accumulation changes to keep the checkpoint's global batch; with it, the config's global batch is the
    layout's on any number of ranks. The given config is never changed: the plan's holds the change."""
    import json

    from eva_fastclip.plan.precision import Hardware
    from eva_fastclip.plan.run_plan import make_plan

    folder = tmp_path / "run" / "checkpoints" / "step_00000003"
    folder.mkdir(parents=True)
    (folder / "COMPLETE.json").write_text(json.dumps({"step": 3, "world_size": 4, "global_batch": 64}))
    cpu = Hardware(cuda=False, native_bf16=False, description="a test CPU")
    for sets, accum, logged in (
        (["train.batch_size=8"], 4, "kept on 2 ranks with train.grad_accum_steps=4 (was 1)"),
        (["train.global_batch=64", "train.max_micro_batch=16"], None, None),
        (["train.global_batch=128"], None, "train.global_batch=128 applies from here"),
    ):
        cfg = load_config(None, [*sets, f"train.output_dir={tmp_path / 'run'}"])
        given = cfg.to_dict()
        plan = make_plan(cfg, {"optimizer": {"type": "Lamb"}}, world_size=2, hardware=cpu, resume="latest",
                         loader_batches=100)  # fmt: skip
        assert plan.resume.folder == folder
        assert plan.config.train.grad_accum_steps == accum
        notes = "\n".join(line for _, line in plan.notes)
        assert (logged in notes) if logged else "was saved" not in notes
        assert cfg.to_dict() == given  # nothing writes back into the config
        if cfg.train.global_batch is None:
            assert plan.layout.global_batch == 64 and batch_layout(plan.config, 2).global_batch == 64


def test_dry_run_validates_for_a_world_size(capsys, tmp_path):
    from eva_fastclip.cli import main
    from eva_fastclip.data import write_toy_dataset

    # the dry-run checks the paths too: the toy config's data, here one epoch of 4 ranks x 64
    write_toy_dataset(
        tmp_path, num_train=256, num_val=8, num_zeroshot=20, image_size=16, samples_per_shard=64
    )
    paths = [f'data.train_shards=["{tmp_path / "train"}"]', f"eval.zeroshot_dir={tmp_path / 'zeroshot'}"]
    paths += [f'eval.retrieval_shards=["{tmp_path / "val"}"]', f"train.output_dir={tmp_path / 'run'}"]
    sets = [arg for path in paths for arg in ("--set", path)]
    assert main(["train", "--config", "configs/toy.json", *sets, "--dry-run", "--world-size", "4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["global_batch"] == 4 * 64 and printed["deepspeed"]["train_batch_size"] == 256
    # a global batch: the same 256 on 2 ranks, in 2 micro-batches of 64 where a rank holds at most 64
    sets += ["--set", "train.batch_size=null", "--set", "train.global_batch=256"]
    sets += ["--set", "train.max_micro_batch=64"]
    assert main(["train", "--config", "configs/toy.json", *sets, "--dry-run", "--world-size", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["batch"] == {
        "global_batch": 256,
        "world_size": 2,
        "per_rank": 128,
        "micro_batch": 64,
        "grad_accum_steps": 2,
        "contrastive_batch": 128,
        "derived_from": "train.global_batch, train.max_micro_batch",
        "warnings": [
            "the contrastive batch shrank to 128 pairs from the reference's 256: its global batch of 256 "
            "takes 2 micro-batches on each of 2 rank(s), and each loss evaluation sees one. Set "
            "train.contrastive_batch=global to train with the reference's (one more forward pass per "
            "micro-batch; docs/losses.md, Gradient accumulation)"
        ],
    }
    deepspeed = printed["deepspeed"]
    assert (deepspeed["train_micro_batch_size_per_gpu"], deepspeed["gradient_accumulation_steps"]) == (64, 2)
    assert main(["train", "--config", "configs/toy.json", "--set", "train.batch_sise=3", "--dry-run"]) == 2
    assert "did you mean 'train.batch_size'" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(Path("configs").glob("*.json")), ids=lambda p: p.name)
def test_shipped_presets_validate(path, tmp_path):
    """Every preset loads and agrees with its DeepSpeed JSON (on a GPU machine, at 8 ranks). The weight
    files a preset names (EVA MIM, OpenAI CLIP) are stood in for by empty files: they are not shipped."""
    from eva_fastclip.plan.deepspeed_json import load_deepspeed_config, resolve_deepspeed_config
    from eva_fastclip.plan.precision import Hardware

    model = json.loads(path.read_text()).get("model", {})
    overrides = []
    for key in ("pretrained", "vision_checkpoint", "text_checkpoint"):
        if model.get(key):
            (tmp_path / key).touch()
            overrides.append(f"model.{key}={tmp_path / key}")
    cfg = load_config(path, overrides)
    ds = resolve_deepspeed_config(
        load_deepspeed_config(cfg.train.deepspeed_config),
        cfg,
        batch_layout(cfg, 8),
        source=str(path),
        hardware=Hardware(cuda=True, native_bf16=True, description="a GPU"),
    )
    layout = batch_layout(cfg, 8)
    assert ds["train_batch_size"] == layout.global_batch == (cfg.train.global_batch or layout.global_batch)
    assert ds["train_micro_batch_size_per_gpu"] == layout.micro_batch
