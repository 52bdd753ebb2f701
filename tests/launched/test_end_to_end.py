"""Two ranks on CPU: train, checkpoint, resume, evaluate, export.

Two launches in all, shared by every test in this module: the user's command through
``launchers/single_node.sh`` and the real ``deepspeed`` launcher, then its resume from the rank pool
(tests/launching.py). FastCLIP-v3 (per-sample
state, the temperature controller, gamma's schedule): 30 steps, then resumed to 40, evaluated during
training (every 20 steps, and at each run's end) on zero-shot, retrieval and an ImageNet folder of 3
images, in batches of 6 (uneven shares; rank 1 holds no ImageNet image): every evaluated step equals one
rank's evaluation of that step's checkpoint exactly, and the zero-shot numbers equal clip_benchmark's own
evaluator on the exported model. OpenCLIP's loss is launched on 2 ranks in
tests/launched/test_cached_step_two_ranks.py (against 1 rank, the whole state).
"""

import json
import os
from pathlib import Path

import open_clip
import pytest
import torch
from launching import REPO, Launch, run_ranks
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.cli import main
from eva_fastclip.config import load_config
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.engine.evaluate import evaluate_model
from eva_fastclip.evaluation import (
    build_zeroshot_classifier,
    classification_metrics,
    classify,
    read_wds_folder,
)
from eva_fastclip.export import consolidated_state_dict, export_open_clip
from eva_fastclip.models import create_model
from eva_fastclip.optim.schedule import WarmupCosine

pytestmark = pytest.mark.launcher

FIRST_STEPS, TOTAL_STEPS = 30, 40
WNIDS = ("n01440764", "n01443537", "n15075141")  # tench, goldfish, toilet paper: 3 of the 1000 classes


def launch(args: list[str], tmp: Path, name: str) -> str:
    """Run ``NUM_GPUS=2 launchers/single_node.sh CONFIG ARGS...`` (``args``: ``train --config CONFIG
    ARGS...``), which execs ``deepspeed --num_gpus 2 --module eva_fastclip train --config CONFIG ARGS...``;
    fail with the log if it fails."""
    assert args[:2] == ["train", "--config"], args
    run = Launch(2, args[2:], tmp / f"{name}.log", script=REPO / "launchers" / "single_node.sh")
    try:
        code = run.wait(timeout=600)
    finally:
        run.kill()
    log = run.output()
    assert code == 0, f"launch failed ({name}):\n{log[-6000:]}"
    # DeepSpeed's CPU all-reduce buffers (67 MB a rank) leave no name behind in /dev/shm
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{run.port}_*"))
    return log


def write_imagenet_folder(root: Path) -> Path:
    """An ImageNet folder of 3 images: one evaluation batch, so rank 1 has no share of it."""
    for i, wnid in enumerate(WNIDS):
        (root / wnid).mkdir(parents=True)
        Image.new("RGB", (40, 40), (80 * i, 200 - 60 * i, 90)).save(root / wnid / f"v{i}.JPEG")
    return root


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    values = {}
    for events in sorted((run_dir / "tensorboard").glob("events.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values.update({e.step: e.value for e in acc.Scalars(tag)})
    return values


@pytest.fixture(scope="module")
def run(tmp_path_factory, rank_pool):
    loss = "fastclip_v3"
    tmp = tmp_path_factory.mktemp(f"e2e_{loss}")
    data = tmp / "toy"
    write_toy_dataset(data, num_train=2048, num_val=128, num_zeroshot=160, samples_per_shard=256, seed=0)
    imagenet = write_imagenet_folder(data / "imagenet")
    out = tmp / "run"
    # evaluated at steps 20 (during the first run), 30 (its end) and 40 (during the resumed run, reused at
    # its end); 160 zero-shot images are 27 batches of 6 (14 on rank 0, 13 on rank 1), 128 retrieval pairs
    # 22 (the last of 2), the ImageNet folder 1; keep_checkpoints=3: every evaluated step's checkpoint stays
    # in fp32 whatever the machine trains in (bf16 where its CPU computes bf16 natively): the one-rank
    # evaluation and clip_benchmark's below evaluate the checkpoint's fp32 weights in fp32
    evaluation = [
        "model.name=test-vit-xs",
        f"eval.zeroshot_dir={data / 'zeroshot'}",
        f'eval.retrieval_shards=["{data / "val"}"]',
        f"eval.imagenet_val={imagenet}",
        "eval.batch_size=6",
        "eval.precision=fp32",
    ]
    common = [
        "train",
        "--config",
        "configs/toy.json",
        *(arg for item in evaluation for arg in ("--set", item)),
        "--set",
        "train.precision=fp32",  # on every CPU kind: auto would be bf16 where the CPU computes it
        "--set",
        "eval.every_steps=20",
        "--set",
        f'data.train_shards=["{data / "train"}"]',
        "--set",
        "data.workers=1",
        "--set",
        "train.batch_size=16",
        "--set",
        f"train.output_dir={out}",
        "--set",
        "train.save_every_steps=10",
        "--set",
        "train.keep_checkpoints=3",
        "--set",
        "train.log_every_steps=1",
        "--set",
        "optim.warmup_steps=5",
        "--set",
        f"loss.name={loss}",
        "--set",
        f"data.num_samples={16 * 2 * 10}",  # 10 steps an epoch: the resumed run is in epoch 3 (gamma < 1)
    ]
    first = launch(common + ["--set", f"train.steps={FIRST_STEPS}"], tmp, "first")
    # the resumed run from the rank pool: the launcher was the first run's, and is the same
    again = [*common, "--set", f"train.steps={TOTAL_STEPS}", "--resume", "latest"]
    second = run_ranks(2, ["--module", "eva_fastclip", *again], tmp / "second.log", pool=rank_pool)
    return {
        "tmp": tmp,
        "out": out,
        "data": data,
        "logs": (first, second),
        "evaluation": evaluation,
    }


def test_loss_falls_and_evaluation_prints_beside_chance(run):
    # the compositional losses log their surrogate as "loss", and v3's objective is scaled by tau ~ 0.07:
    # the batch's GCL, mean log(eps + g), is what must fall
    losses = scalars(run["out"], "train/loss/gcl")
    losses = {s: v for s, v in losses.items() if s <= FIRST_STEPS}
    assert sorted(losses) == list(range(1, FIRST_STEPS + 1))
    early = sum(losses[s] for s in range(1, 6)) / 5
    late = sum(losses[s] for s in range(FIRST_STEPS - 4, FIRST_STEPS + 1)) / 5
    assert late < early - 0.1, f"loss did not fall: first steps {early:.3f}, last steps {late:.3f}"
    assert "zero-shot top1" in run["logs"][0] and "chance" in run["logs"][0]
    metrics = json.loads((run["out"] / "final_metrics.json").read_text())
    assert metrics["step"] == TOTAL_STEPS
    assert metrics["zeroshot_num_samples"] == 160 and metrics["retrieval_num_samples"] == 128
    assert 0.0 <= metrics["zeroshot_top1"] <= 1.0


def test_resume_continues_from_the_saved_step(run):
    assert "resumed from" in run["logs"][1] and "step_00000030" in run["logs"][1]
    # every rank's range of per-sample state was saved and read back
    assert sorted(
        p.name for p in (run["out"] / "checkpoints" / "step_00000040" / "per_sample").iterdir()
    ) == [
        "per_sample_000000000000-000000001024.pt",
        "per_sample_000000001024-000000002048.pt",
    ]
    gammas = scalars(run["out"], "train/gamma")
    assert gammas[1] == 1.0 and gammas[TOTAL_STEPS] < 1.0
    steps = sorted(scalars(run["out"], "train/loss"))
    assert steps == list(range(1, TOTAL_STEPS + 1))  # the second run logged 31..40, nothing twice
    kept = [p.name for p in checkpoint.complete_checkpoints(run["out"] / "checkpoints")]
    assert kept == ["step_00000020", "step_00000030", "step_00000040"]  # keep_checkpoints=3
    # logged after step s: the lr of the next step, schedule(s). The first run's decay had ended at step 30;
    # raised to 40 steps, the resumed run goes on from there (the rest of the decay stretched: none is left)
    lrs = scalars(run["out"], "train/lr/visual")
    schedule = WarmupCosine(warmup=5, total=FIRST_STEPS, min_ratio=0.0)
    schedule.retarget(FIRST_STEPS, TOTAL_STEPS)
    for step in (30, 31, 35, 39):
        assert lrs[step] == pytest.approx(1e-3 * schedule(step), rel=1e-4, abs=1e-12)


def test_export_loads_into_open_clip_with_every_key(run):
    folder = run["out"] / "checkpoints" / "step_00000040"
    target = run["tmp"] / "exported.pt"
    summary = export_open_clip(folder, target)  # verifies a strict open_clip load itself
    assert summary["architecture"] == "test-vit-xs"
    model = open_clip.create_model("test-vit-xs", pretrained=str(target))
    state = torch.load(target)
    assert state["logit_scale"].ndim == 0  # open_clip's own shape
    torch.testing.assert_close(model.state_dict()["visual.conv1.weight"], state["visual.conv1.weight"])


def test_eval_command_on_the_export_and_the_checkpoint(run, capsys):
    data = run["data"]
    args = [
        "--config",
        "configs/toy.json",
        "--set",
        "model.name=test-vit-xs",
        "--set",
        f"eval.zeroshot_dir={data / 'zeroshot'}",
        "--set",
        f'eval.retrieval_shards=["{data / "val"}"]',
        "--set",
        "eval.precision=fp32",  # an export records no training precision: fp32 for the folder too
    ]
    folder = run["out"] / "checkpoints" / "step_00000040"
    assert main(["eval", *args, "--checkpoint", str(folder)]) == 0
    from_checkpoint = capsys.readouterr().out
    export_open_clip(folder, run["tmp"] / "for_eval.pt")
    assert main(["eval", *args, "--checkpoint", str(run["tmp"] / "for_eval.pt")]) == 0
    from_export = capsys.readouterr().out
    assert "zero-shot top1 (160 images)" in from_export
    export_open_clip(folder, run["tmp"] / "for_eval")  # open_clip's own folder
    assert main(["eval", *args, "--checkpoint", str(run["tmp"] / "for_eval")]) == 0
    from_folder = capsys.readouterr().out
    # the same weights give the same figures, whichever form they come in
    assert from_checkpoint.splitlines()[-1] == "evaluated in fp32 (eval.precision=fp32)"
    assert from_export.splitlines()[-7:] == from_checkpoint.splitlines()[-7:]
    assert from_folder.splitlines()[-7:] == from_checkpoint.splitlines()[-7:]


def one_rank_evaluation(folder: Path, sets: list[str]) -> dict:
    cfg = load_config("configs/toy.json", [*sets, "eval.workers=0"])
    bundle = create_model(cfg.model)
    bundle.model.load_state_dict(consolidated_state_dict(folder))
    return evaluate_model(bundle.model, bundle, cfg.eval, device=torch.device("cpu"), dtype=torch.float32)


def scalar_events(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """Every (step, value) of ``tag`` in the run's event files, in the order written (runs in order)."""
    events = []
    for path in sorted((run_dir / "tensorboard").glob("events.*")):
        acc = EventAccumulator(str(path))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            events += [(e.step, e.value) for e in acc.Scalars(tag)]
    return events


def test_two_ranks_evaluate_every_step_as_one_rank_does(run):
    """Every evaluated step's results in eval_results.jsonl (the resumed run appending to the first's) and
    TensorBoard equal one rank's evaluation of that step's checkpoint exactly, with uneven shares and a rank
    without any ImageNet image; final_metrics.json is the step-40 evaluation, reused."""
    out = run["out"]
    lines = [json.loads(line) for line in (out / "eval_results.jsonl").read_text().splitlines()]
    assert [(line["step"], line["epoch"]) for line in lines] == [(20, 1), (30, 2), (40, 3)]
    for line in lines:
        metrics = {k: v for k, v in line.items() if k not in ("step", "epoch")}
        assert metrics["imagenet_num_classes"] == 3 and metrics["imagenet_num_samples"] == 3
        assert metrics["zeroshot_num_samples"] == 160 and metrics["retrieval_num_samples"] == 128
        folder = out / "checkpoints" / f"step_{line['step']:08d}"
        assert one_rank_evaluation(folder, run["evaluation"]) == metrics
    final = json.loads((out / "final_metrics.json").read_text())
    assert final.pop("throughput")["samples_per_s_per_rank"] > 0  # the last run's (engine/throughput.py)
    assert final == {k: v for k, v in lines[-1].items() if k != "epoch"}  # the step-40 evaluation, reused
    for key in ("zeroshot_top1", "imagenet_top5", "retrieval_text_to_image_R@1"):
        assert scalar_events(out, f"eval/{key}") == [
            (line["step"], pytest.approx(line[key], rel=1e-6)) for line in lines
        ]


def accuracy(output, target, topk=(1,)):
    """clip_benchmark's top-k accuracy with its float() of a 1-element array (an error under numpy 2)
    taken on the sum itself: patched in at call time."""
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [float(correct[:k].reshape(-1).float().sum()) / len(target) for k in topk]


def test_zero_shot_equals_clip_benchmarks_evaluator_on_the_exported_model(run, tmp_path, monkeypatch):
    from clip_benchmark.datasets.builder import build_dataset
    from clip_benchmark.metrics import zeroshot_classification as zsc

    data, out = run["data"], run["out"]
    export_open_clip(out / "checkpoints" / "step_00000040", tmp_path / "exported")
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
    step40 = json.loads((out / "eval_results.jsonl").read_text().splitlines()[-1])
    assert (step40["zeroshot_top1"], step40["zeroshot_top5"]) == (theirs["acc1"], theirs["acc5"])
