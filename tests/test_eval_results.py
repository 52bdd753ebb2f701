"""Evaluation during training on two ranks (one real launch through the deepspeed launcher, fp32 on CPU):
every evaluated step's results in eval_results.jsonl and TensorBoard equal one rank's evaluation of that
step's checkpoint exactly, with uneven shares and a rank without any ImageNet image; the zero-shot numbers
equal clip_benchmark's own evaluator on the exported model. A resumed run appends to eval_results.jsonl."""

import json
from pathlib import Path

import open_clip
import pytest
import torch
from PIL import Image
from test_resume import SixBatches, launch

from eva_fastclip.config import load_config
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.engine.build import build_trainer
from eva_fastclip.engine.evaluate import evaluate_model
from eva_fastclip.evaluation import (
    build_zeroshot_classifier,
    classification_metrics,
    classify,
    read_wds_folder,
)
from eva_fastclip.export import consolidated_state_dict, export_open_clip
from eva_fastclip.models import create_model
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

WNIDS = ("n01440764", "n01443537", "n15075141")  # tench, goldfish, toilet paper: 3 of the 1000 classes


def eval_sets(root: Path) -> list[str]:
    """The toy data (26 zero-shot images: 7 batches of 4, 4 on rank 0 and 3 on rank 1; 10 retrieval
    pairs) and an ImageNet folder of 3 images: one batch, so rank 1 has no share of it."""
    write_toy_dataset(root, num_train=32, num_val=10, num_zeroshot=26, image_size=32, samples_per_shard=8)
    for i, wnid in enumerate(WNIDS):
        (root / "imagenet" / wnid).mkdir(parents=True)
        Image.new("RGB", (40, 40), (80 * i, 200 - 60 * i, 90)).save(root / "imagenet" / wnid / f"v{i}.JPEG")
    return [
        f"eval.zeroshot_dir={root / 'zeroshot'}",
        f'eval.retrieval_shards=["{root / "val"}"]',
        f"eval.imagenet_val={root / 'imagenet'}",
        "eval.batch_size=4",
    ]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    data = tmp_path_factory.mktemp("eval_data")
    out = tmp_path_factory.mktemp("eval_run")
    sets = [
        *eval_sets(data),
        "eval.every_steps=1",
        "eval.workers=1",
        "model.name=test-vit-xs",
        f'data.train_shards=["{data / "train"}"]',
        "data.num_samples=32",
        "train.precision=fp32",
        "train.batch_size=8",
        "train.steps=2",
        "train.save_every_steps=1",
        "train.keep_checkpoints=3",
        f"train.output_dir={out}",
        "optim.warmup_steps=1",
    ]
    args = ["train", "--config", "configs/toy.json", *[arg for item in sets for arg in ("--set", item)]]
    launch(2, args, out / "launch.log")
    return data, out, sets


def one_rank_evaluation(folder: Path, sets: list[str]) -> dict:
    cfg = load_config("configs/toy.json", [*sets, "eval.workers=0"])
    bundle = create_model(cfg.model)
    bundle.model.load_state_dict(consolidated_state_dict(folder))
    return evaluate_model(bundle.model, bundle, cfg.eval, device=torch.device("cpu"), dtype=torch.float32)


@pytest.mark.launcher
def test_two_ranks_evaluate_every_step_as_one_rank_does(launched):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, sets = launched
    lines = [json.loads(line) for line in (out / "eval_results.jsonl").read_text().splitlines()]
    assert [(line["step"], line["epoch"]) for line in lines] == [(1, 0), (2, 0)]
    for line in lines:
        metrics = {k: v for k, v in line.items() if k not in ("step", "epoch")}
        assert metrics["imagenet_num_classes"] == 3 and metrics["imagenet_num_samples"] == 3
        assert metrics["zeroshot_num_samples"] == 26 and metrics["retrieval_num_samples"] == 10
        assert one_rank_evaluation(out / "checkpoints" / f"step_{line['step']:08d}", sets) == metrics
    final = json.loads((out / "final_metrics.json").read_text())
    assert final == {k: v for k, v in lines[-1].items() if k != "epoch"}  # the step-2 evaluation, reused
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for key in ("zeroshot_top1", "imagenet_top5", "retrieval_text_to_image_R@1"):
        assert [(e.step, e.value) for e in events.Scalars(f"eval/{key}")] == [
            (line["step"], pytest.approx(line[key], rel=1e-6)) for line in lines
        ]


def accuracy(output, target, topk=(1,)):
    """clip_benchmark's top-k accuracy with its float() of a 1-element array (an error under numpy 2)
    taken on the sum itself: patched in at call time."""
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [float(correct[:k].reshape(-1).float().sum()) / len(target) for k in topk]


@pytest.mark.launcher
def test_zero_shot_equals_clip_benchmarks_evaluator_on_the_exported_model(launched, tmp_path, monkeypatch):
    from clip_benchmark.datasets.builder import build_dataset
    from clip_benchmark.metrics import zeroshot_classification as zsc

    data, out, _ = launched
    export_open_clip(out / "checkpoints" / "step_00000002", tmp_path / "exported")
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'exported'}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{tmp_path / 'exported'}")
    model.eval()

    dataset = build_dataset("wds/toy", root=str(data / "zeroshot"), transform=preprocess, download=False)
    loader = torch.utils.data.DataLoader(dataset.batched(5), batch_size=None)
    monkeypatch.setattr(zsc, "accuracy", accuracy)
    theirs = zsc.evaluate(model, loader, tokenizer, dataset.classes, dataset.templates, "cpu", amp=False)

    evalset = read_wds_folder(data / "zeroshot")
    classifier = build_zeroshot_classifier(
        model, tokenizer, evalset.classnames, evalset.templates, device="cpu"
    )
    predictions = classify(model, classifier, evalset, preprocess=preprocess, batch_size=4, device="cpu")
    ours = classification_metrics(
        predictions.labels, predictions.top_classes, predictions.predicted, predictions.num_classes
    )
    assert (ours["top1"], ours["top5"], ours["mean_per_class_recall"]) == (
        theirs["acc1"],
        theirs["acc5"],
        theirs["mean_per_class_recall"],
    )
    step2 = json.loads((out / "eval_results.jsonl").read_text().splitlines()[-1])
    assert (step2["zeroshot_top1"], step2["zeroshot_top5"]) == (theirs["acc1"], theirs["acc5"])


def test_a_resumed_run_appends_to_eval_results(tmp_path):
    """3 steps, evaluated every step; resumed from step 2 to step 4: steps 1-4 once each (the step-3 line of
    the first run goes: the resumed run evaluates step 3 again); resumed when finished: step 4 once."""
    sets = eval_sets(tmp_path / "data")[:1] + ["eval.retrieval_shards=null", "eval.every_steps=1"]
    sets += ["eval.workers=0", "eval.batch_size=8"]

    def run(steps, resume=None):
        cfg = load_config(
            "configs/toy.json",
            [
                *sets,
                "model.name=test-vit-xs",
                "train.precision=fp32",
                "train.batch_size=8",
                f"train.steps={steps}",
                "train.save_every_steps=2",
                f"train.output_dir={tmp_path / 'run'}",
                "optim.warmup_steps=1",
            ],
        )
        build_trainer(
            cfg, load_deepspeed_config(cfg.train.deepspeed_config), resume=resume, loader=SixBatches()
        ).train()
        lines = (tmp_path / "run" / "eval_results.jsonl").read_text().splitlines()
        return [json.loads(line)["step"] for line in lines]

    assert run(3) == [1, 2, 3]
    assert run(4, resume=str(tmp_path / "run" / "checkpoints" / "step_00000002")) == [1, 2, 3, 4]
    assert run(4, resume="latest") == [1, 2, 3, 4]
