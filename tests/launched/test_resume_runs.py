"""Resume anywhere, with real runs: a run killed with SIGKILL and resumed reproduces the uninterrupted run;
a checkpoint resumes on another number of ranks through DeepSpeed's universal checkpoint. (The data
stream, the schedule and what a resume may change, in one process: tests/test_resume.py.)

Eight launches of the rank pool (the launcher is not under test here; launched/conftest.py), tiny model,
fp32 on CPU, 2 loader workers per rank (the resumed streams go on across them), no watchdog:

- per layout (1 rank; 2 ranks with ``train.contrastive_batch=global``): an uninterrupted run of 8 steps, a
  run killed (SIGKILL to its whole process group: ranks and loader workers) right after its step-3
  checkpoint, and its resume;
- a ResNet tower (BatchNorm) with the micro contrastive batch trained 3 steps on 2 ranks, whose step-3
  checkpoint a Trainer in this process resumes on 1 rank;
- the step-3 checkpoint of the 1-rank killed run resumed on 2 ranks.
"""

import logging
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from launched_train import loaded_state
from launching import run_ranks, train_args
from stand_ins import SixBatches, files_of, step_log

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.config import load_config
from eva_fastclip.engine.build import build_trainer
from eva_fastclip.export import consolidated_state_dict
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

STEPS, KILL_AFTER, GLOBAL = 8, 3, 16  # 5 steps an epoch: the resumed runs cross into epoch 1
MICRO = 8  # pairs a micro-batch
MODULE = ["--module", "eva_fastclip"]


def run_args(
    data: Path, out: Path, ranks: int, steps: int = STEPS, extra=(), micro: int = MICRO
) -> list[str]:
    return train_args(
        "model.name=test-vit-xs",
        "model.patch_dropout=0.5",  # each sample's mask from its key: the same after the resume
        "loss.name=fastclip_v3",  # per-sample state, the temperature controller, gamma's schedule
        f'data.train_shards=["{data / "train"}"]',
        "data.workers=2",
        "data.shuffle_buffer=10",
        f"data.num_samples={5 * GLOBAL}",  # 5 steps an epoch; the 64 samples run out: a second pass
        "eval.zeroshot_dir=null",
        "eval.retrieval_shards=null",
        "train.precision=fp32",
        f"train.batch_size={micro}",
        f"train.grad_accum_steps={GLOBAL // micro // ranks}",
        f"train.steps={steps}",
        f"train.save_every_steps={KILL_AFTER}",
        "train.keep_checkpoints=3",
        f"train.output_dir={out}",
        "train.hang_timeout_s=0",
        "optim.warmup_steps=2",
        *extra,
    )


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def killed_after(group, marker: Path, timeout: float = 600) -> None:
    """SIGKILL to the whole launch (its ranks, their loader workers) as soon as ``marker`` exists; fails if
    a rank ended first. Returns once every rank is gone."""
    ranks = [psutil.Process(pid) for pid in group.pids]
    deadline = time.monotonic() + timeout
    try:
        while not marker.exists():
            assert all(map(running, ranks)), f"the launch ended before its kill:\n{group.output()[-6000:]}"
            assert time.monotonic() < deadline, "no checkpoint to kill after"
            time.sleep(0.02)
        assert all(map(running, ranks)), f"the launch ended before its kill:\n{group.output()[-6000:]}"
    finally:
        group.kill(signal.SIGKILL)
    assert group.wait(0) == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while any(map(running, ranks)):
        assert time.monotonic() < deadline, "a killed rank is still running"
        time.sleep(0.05)


#: the layouts killed and resumed: number of ranks -> (ranks, micro-batch, extra settings); "2-global": 2
#: ranks x 2 micro-batches of 4 with the contrastive batch of the whole step (a cached step)
LAYOUTS = {1: (1, MICRO, ()), "2-global": (2, 4, ("train.contrastive_batch=global",))}
KILLED = tuple(LAYOUTS)


@pytest.fixture(scope="module")
def runs(toy_data, rank_pool, tmp_path_factory):
    """Per layout: an uninterrupted run, a run killed right after its step-3 checkpoint, and that run
    resumed with --resume latest."""
    result = {}
    for name, (ranks, micro, extra) in LAYOUTS.items():
        tmp = tmp_path_factory.mktemp(f"resume_{name}ranks")

        def args(out, ranks=ranks, extra=extra, micro=micro):
            return [*MODULE, *run_args(toy_data, out, ranks, extra=extra, micro=micro)]

        whole = run_ranks(ranks, args(tmp / "whole"), tmp / "whole.log", pool=rank_pool)
        marker = tmp / "killed" / "checkpoints" / checkpoint.tag_for_step(KILL_AFTER) / checkpoint.MARKER
        killed_after(rank_pool.launch(ranks, args(tmp / "killed"), tmp / "killed.log"), marker)
        killed_log = step_log(tmp / "killed")
        step3 = tmp / "step3" / marker.parent.name  # kept for the other number of ranks
        shutil.copytree(marker.parent, step3)
        resumed = run_ranks(
            ranks, [*args(tmp / "killed"), "--resume", "latest"], tmp / "resumed.log", pool=rank_pool
        )
        result[name] = {"tmp": tmp, "logs": (whole, resumed), "killed_log": killed_log, "step3": step3}
    return result


@pytest.mark.parametrize("ranks", KILLED)
def test_a_killed_run_resumes_exactly(runs, ranks):
    """The killed run's lock on its folder (reliability/run_lock.py) is stale: its holder, rank 0, is gone.
    The resume takes it over and says so, then reproduces the uninterrupted run."""
    tmp = runs[ranks]["tmp"]
    resumed_output = runs[ranks]["logs"][1]
    assert f"resumed from {tmp / 'killed' / 'checkpoints'}" in resumed_output
    takeover = [line for line in resumed_output.splitlines() if "taking over" in line]
    assert len(takeover) == 1 and f"{tmp / 'killed' / 'run.lock'} from the run that held it" in takeover[0]
    assert "is gone" in takeover[0], takeover
    killed_steps = [record["step"] for record in runs[ranks]["killed_log"]]
    assert KILL_AFTER <= killed_steps[-1] < STEPS  # killed after its checkpoint, before its end
    whole, resumed = step_log(tmp / "whole"), step_log(tmp / "killed")
    assert [r["step"] for r in whole] == [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert resumed[:KILL_AFTER] == runs[ranks]["killed_log"][:KILL_AFTER]  # kept from the killed run
    assert {r["epoch"] for r in whole} == {0, 1}
    for want, got in zip(whole, resumed):
        assert want.keys() == got.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-30), (want["step"], key)
    final = checkpoint.tag_for_step(STEPS)
    want = consolidated_state_dict(tmp / "whole" / "checkpoints" / final)
    got = consolidated_state_dict(tmp / "killed" / "checkpoints" / final)
    assert want.keys() == got.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=0, msg=name)
    for path in (tmp / "whole" / "checkpoints" / final / "per_sample").iterdir():
        table = torch.load(path)["values"]
        other = torch.load(tmp / "killed" / "checkpoints" / final / "per_sample" / path.name)["values"]
        torch.testing.assert_close(other, table, rtol=1e-6, atol=0)


def zero_state(folder: Path) -> dict:
    """Every parameter's fp32 weights and moments, and every group's step, merged from the ZeRO partitions
    of all ranks by their slice mappings: written out here, not through DeepSpeed's converter."""
    files = sorted(folder.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    parts = [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in files]
    shapes = {}
    for group in torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)["param_shapes"]:
        shapes.update(group)
    merged, steps = {}, []
    for g in range(len(parts[0]["param_slice_mappings"])):
        steps.append({int(part["base_optimizer_state"]["state"][g]["step"]) for part in parts})
        for name in shapes:
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                pieces = []
                for part in parts:
                    fragment = part["param_slice_mappings"][g].get(name)
                    if fragment is not None:
                        flat = part["single_partition_of_fp32_groups"][g] if key == "fp32" else None
                        flat = part["base_optimizer_state"]["state"][g][key] if flat is None else flat
                        pieces.append(flat.narrow(0, fragment.start, fragment.numel))
                if pieces:
                    merged.setdefault(name, {})[key] = torch.cat(pieces).reshape(shapes[name])
    return {"params": merged, "steps": steps, "ranks": len(parts)}


RESNET = [
    "model.name=test-rn-xs",
    "model.patch_dropout=0.0",
    "loss.name=fastclip_v3",  # a per-sample table crosses to the other number of ranks too
    "data.workers=0",  # the resume below reads stand-in batches
]


@pytest.fixture(scope="module")
def resnet_on_two_ranks(toy_data, rank_pool, tmp_path_factory):
    """A ResNet vision tower (BatchNorm: persistent buffers) trained 3 steps on 2 ranks and saved."""
    out = tmp_path_factory.mktemp("resnet")
    args = run_args(toy_data, out / "run", 2, steps=KILL_AFTER, extra=RESNET)
    run_ranks(2, [*MODULE, *args], out / "run.log", pool=rank_pool)
    return out / "run"


def test_two_ranks_resume_on_one_with_every_buffer_and_moment(
    resnet_on_two_ranks, toy_data, tmp_path, caplog
):
    """The ResNet run's step-3 checkpoint (2 ranks), resumed on 1 rank in this process with the 2-rank run's
    own command, 2 steps longer: converted beside the original (DeepSpeed's universal checkpoint), the global
    batch kept by the accumulation, fp32 weights, moments and steps loaded exactly as saved (merged from the
    saved partitions by the test, gathered from the loaded ones by DeepSpeed's accessors), every persistent
    buffer (BatchNorm's running statistics and counts) the saved one, which three training forwards moved
    from its initial value; the run trains on 2 steps and saves, and the folder it resumed from stays as it
    was, byte for byte the 2-rank run's save."""
    out = tmp_path / "run"
    source = resnet_on_two_ranks / "checkpoints" / checkpoint.tag_for_step(KILL_AFTER)
    folder = out / "checkpoints" / source.name
    shutil.copytree(source, folder)
    before = files_of(folder, mtimes=True)
    saved = zero_state(source)
    saved_module = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    overrides = run_args(toy_data, out, 2, steps=KILL_AFTER + 2, extra=RESNET)[4::2]
    cfg = load_config("configs/toy.json", overrides)
    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    caplog.set_level(logging.INFO, logger="eva_fastclip")
    trainer = build_trainer(cfg, ds, resume="latest", loader=SixBatches())
    assert trainer.resume_from == (folder, checkpoint.universal_folder(folder))
    assert f"converting {folder} " in caplog.text and f"{folder}.universal" in caplog.text
    assert "kept on 1 ranks with train.grad_accum_steps=2 (was 1)" in caplog.text
    loaded = loaded_state(trainer)
    assert saved["ranks"] == 2
    assert saved["steps"] == [{KILL_AFTER}] * len(saved["steps"])
    assert loaded["steps"] == [KILL_AFTER] * len(saved["steps"])
    assert loaded["params"].keys() == saved["params"].keys()
    for name, tensors in saved["params"].items():
        for key, value in tensors.items():
            assert torch.equal(loaded["params"][name][key].reshape(value.shape), value), (name, key)
    module = trainer.engine.module
    params = dict(module.named_parameters())
    buffers = {name: value for name, value in module.state_dict().items() if name not in params}
    assert sum(name.endswith("running_var") for name in buffers) >= 10  # every BatchNorm of the tower
    for name, value in buffers.items():
        assert torch.equal(value, saved_module[name]), name
        if name.endswith("num_batches_tracked"):  # rank 0's 3 steps of 1 micro-batch each
            assert int(value) == KILL_AFTER, name
        elif name.endswith("running_var"):
            assert not torch.equal(value, torch.ones_like(value)), name
    trainer.train()
    final = out / "checkpoints" / checkpoint.tag_for_step(KILL_AFTER + 2)
    assert checkpoint.is_complete(final) and checkpoint.read_marker(final)["world_size"] == 1
    assert [r["step"] for r in step_log(out)] == [KILL_AFTER + 1, KILL_AFTER + 2]
    assert files_of(folder, mtimes=True) == before
    assert files_of(folder) == files_of(source)  # byte for byte the 2-rank run's save


@pytest.fixture(scope="module")
def one_rank_on_two(runs, toy_data, rank_pool, tmp_path_factory):
    """The 1-rank killed run's step-3 checkpoint resumed on 2 ranks with the 1-rank command (its
    accumulation), for 2 more steps, through tests/launched_train.py, which dumps what each rank loaded."""
    tmp = tmp_path_factory.mktemp("from_1_rank")
    out, dumps = tmp / "run", tmp / "loaded"
    original = out / "checkpoints" / runs[1]["step3"].name
    shutil.copytree(runs[1]["step3"], original)
    args = [*run_args(toy_data, out, 1, steps=KILL_AFTER + 2), "--resume", "latest"]
    log = run_ranks(
        2,
        ["tests/launched_train.py", *args],
        tmp / "run.log",
        pool=rank_pool,
        env={"EVA_TEST_DUMP_LOADED": str(dumps)},
    )
    return {
        "out": out,
        "log": log,
        "copy": runs[1]["step3"],
        "saved": zero_state(runs[1]["step3"]),
        "loaded": [torch.load(dumps / f"rank_{rank}.pt") for rank in range(2)],
    }


def test_one_rank_resumes_on_two(one_rank_on_two):
    """The 1-rank step-3 checkpoint, resumed on 2 ranks: converted beside the original, the global batch
    kept by the accumulation, fp32 weights, moments and steps loaded exactly as saved (merged from the saved
    partitions by the test, gathered from the loaded ones by DeepSpeed's accessors), the original left as it
    was (no save replaces it); then 2 more steps train."""
    run, ranks = one_rank_on_two, 2
    original = run["out"] / "checkpoints" / checkpoint.tag_for_step(KILL_AFTER)
    assert f"converting {original} " in run["log"] and f"{original}.universal" in run["log"]
    assert f"kept on {ranks} ranks with train.grad_accum_steps=1 (was 2)" in run["log"]
    saved, loaded = run["saved"], run["loaded"]
    assert saved["ranks"] == 1
    assert saved["steps"] == [{KILL_AFTER}] * len(saved["steps"])
    assert [rank["steps"] for rank in loaded] == [[KILL_AFTER] * len(saved["steps"])] * ranks
    params = loaded[0]["params"]
    assert params.keys() == saved["params"].keys()
    for name, tensors in saved["params"].items():
        for key, value in tensors.items():
            assert torch.equal(params[name][key].reshape(value.shape), value), (name, key)
    assert files_of(original) == files_of(run["copy"])  # byte for byte the other number of ranks' save
    assert [r["step"] for r in step_log(run["out"])] == [KILL_AFTER + 1, KILL_AFTER + 2]
    final = run["out"] / "checkpoints" / checkpoint.tag_for_step(KILL_AFTER + 2)
    assert checkpoint.read_marker(final)["world_size"] == ranks
