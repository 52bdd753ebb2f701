"""Exit code 2 means a configuration or input problem found before step 1, and nothing else
(docs/reliability.md, Exit codes): a damaged checkpoint file is named with its path in one line, exit 2;
a ValueError or FileNotFoundError once training has started is a failure, exit 1 with its traceback, which
the launch supervisor and the Kubernetes manifest retry. Real files, one rank in this process."""

import json
import os
import subprocess
import sys

import pytest
from launching import REPO, train_args
from stand_ins import TINY, SixBatches, toy_config, toy_trainer

from eva_fastclip.cli import main
from eva_fastclip.data import write_toy_dataset

STEPS = 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("exit_codes")
    write_toy_dataset(root, num_train=64, num_val=8, num_zeroshot=20, image_size=32, samples_per_shard=16)
    return root


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of STEPS steps (FastCLIP-v3: it saves per-sample state too) with its checkpoint."""
    out = tmp_path_factory.mktemp("saved") / "run"
    cfg = toy_config(
        out, f"train.steps={STEPS}", "train.batch_size=8", "loss.name=fastclip_v3", "optim.warmup_steps=1"
    )
    toy_trainer(cfg, loader=SixBatches()).train()
    return out


def resume_args(data, out):
    sets = (*TINY, f'data.train_shards=["{data / "train"}"]', f"train.output_dir={out}", "train.batch_size=8")
    sets = (*sets, "optim.warmup_steps=1")
    return [*train_args(*sets, "loss.name=fastclip_v3", f"train.steps={STEPS + 1}"), "--resume", "latest"]


@pytest.mark.parametrize(
    "damage, named",
    [
        ("empty marker", "COMPLETE.json is not valid JSON"),
        ("marker that is no object", "COMPLETE.json is not a checkpoint's marker (not a JSON object)"),
        ("truncated rank state", "rank_00000.pt is truncated or damaged"),
        ("truncated per-sample state", ".pt is truncated or damaged"),
    ],
)
def test_a_damaged_checkpoint_file_is_named_in_one_line(saved, data, tmp_path, capsys, damage, named):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(saved, out)
    folder = out / "checkpoints" / f"step_{STEPS:08d}"
    if damage == "empty marker":
        (folder / "COMPLETE.json").write_text("")
    elif damage == "marker that is no object":
        (folder / "COMPLETE.json").write_text(json.dumps([1]))
    elif damage == "truncated rank state":
        path = folder / "rank_state" / "rank_00000.pt"
        path.write_bytes(path.read_bytes()[:100])
    else:
        (path,) = (folder / "per_sample").glob("per_sample_*.pt")
        path.write_bytes(path.read_bytes()[:100])
    code = main(resume_args(data, out))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = err.splitlines()
    assert "eva-fastclip train: error: " in err
    (line,) = [line for line in lines if named in line]  # one line names the file and the way out
    assert str(folder) in line and "--resume FOLDER" in line, line


def test_a_failure_after_training_started_is_exit_1_with_its_traceback(data, tmp_path):
    """The zero-shot folder checked before step 1 is gone by the final evaluation: not a configuration
    error (exit 2, which nothing retries) but a failure of the run, its traceback in the log, exit 1."""
    out = tmp_path / "run"
    gone = f"{data / 'zeroshot'}_copy"
    sets = (*TINY, f'data.train_shards=["{data / "train"}"]', f"train.output_dir={out}", "train.batch_size=8")
    argv = train_args(*sets, f"train.steps={STEPS}", f"eval.zeroshot_dir={gone}")
    script = f"""
import shutil, sys
sys.path[:0] = [{str(REPO / "tests")!r}]
from stand_ins import SixBatches
from eva_fastclip.cli import main
from eva_fastclip.engine import trainer as trainer_module

class Vanishing(SixBatches):
    def __iter__(self):  # the set goes while the run trains (a disk unmounted, a folder moved)
        shutil.rmtree({gone!r}, ignore_errors=True)
        yield from super().__iter__()

trainer_module.TrainLoader.for_run = staticmethod(lambda *args, **kwargs: Vanishing())
sys.exit(main({argv!r}))
"""
    import shutil

    shutil.copytree(data / "zeroshot", gone)
    # (an in-process Trainer of this worker set MASTER_PORT, to the port its store still holds)
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")
    }
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback (most recent call last)" in result.stderr
    assert "RunFailed: the run failed after it started: " in result.stderr
    recorded = json.loads((out / "run_exit.json").read_text())
    assert recorded["code"] == 1  # what the launch supervisor reads: a failure it restarts
