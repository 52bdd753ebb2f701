"""Two ranks through the real ``deepspeed`` launcher on CPU: train, checkpoint, resume, evaluate, export.

Two launches in all (~1 minute each on 2 cores), shared by every test in this module, with FastCLIP-v3
(per-sample state, the temperature controller, gamma's schedule). OpenCLIP's loss goes through the
launcher in tests/test_cached_step.py (2 ranks against 1, the whole state).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import open_clip
import pytest
import torch
from launching import free_port, launcher_env
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.cli import main
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.export import export_open_clip
from eva_fastclip.optim.schedule import WarmupCosine

pytestmark = pytest.mark.launcher

REPO = Path(__file__).parents[1]
FIRST_STEPS, TOTAL_STEPS = 30, 40


def launch(args: list[str], tmp: Path, name: str) -> str:
    """Run ``deepspeed --num_gpus 2 --module eva_fastclip ...``; fail with the log if it fails."""
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(port)]
    cmd += ["--module", "eva_fastclip"]
    result = subprocess.run(
        cmd + args, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=600
    )
    log = result.stdout + result.stderr
    (tmp / f"{name}.log").write_text(log)
    assert result.returncode == 0, f"launch failed ({name}):\n{log[-6000:]}"
    # DeepSpeed's CPU all-reduce buffers (67 MB a rank) leave no name behind in /dev/shm
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    return log


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    values = {}
    for events in sorted((run_dir / "tensorboard").glob("events.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values.update({e.step: e.value for e in acc.Scalars(tag)})
    return values


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    loss = "fastclip_v3"
    tmp = tmp_path_factory.mktemp(f"e2e_{loss}")
    data = tmp / "toy"
    write_toy_dataset(data, num_train=2048, num_val=128, num_zeroshot=160, samples_per_shard=256, seed=0)
    out = tmp / "run"
    common = [
        "train",
        "--config",
        "configs/toy.json",
        "--set",
        "model.name=test-vit-xs",
        "--set",
        f'data.train_shards=["{data / "train"}"]',
        "--set",
        "data.workers=1",
        "--set",
        f"eval.zeroshot_dir={data / 'zeroshot'}",
        "--set",
        f'eval.retrieval_shards=["{data / "val"}"]',
        "--set",
        "train.batch_size=16",
        "--set",
        f"train.output_dir={out}",
        "--set",
        "train.save_every_steps=10",
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
    second = launch(common + ["--set", f"train.steps={TOTAL_STEPS}", "--resume", "latest"], tmp, "second")
    return {
        "tmp": tmp,
        "out": out,
        "data": data,
        "logs": (first, second),
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
    assert kept == ["step_00000030", "step_00000040"]  # keep_checkpoints=2
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
    assert from_export.splitlines()[-6:] == from_checkpoint.splitlines()[-6:]
    assert from_folder.splitlines()[-6:] == from_checkpoint.splitlines()[-6:]
