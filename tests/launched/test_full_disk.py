"""A full disk loses nothing (checkpointing/checkpoint.py), provoked for real: every process of a launch under
a file-size limit (RLIMIT_FSIZE, ``ulimit -f``), so the kernel refuses the checkpoint's large files with
EFBIG, as a full file system refuses them with ENOSPC. The save fails on every rank together, leaves no folder
that looks complete, names the folder, the error and the sizes, and stops the run with code 4; the previous
complete checkpoint and ``latest`` are intact, and a run without the limit resumes from them."""

import resource
import time

import pytest
from test_preemption import Run, all_gone, last_complete, train_args

from eva_fastclip.checkpointing import checkpoint

pytestmark = pytest.mark.launcher

LIMIT = 2 * 2**20  # bytes a process may write to one file: the logs fit, the model's states (6 MB) do not


def limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from eva_fastclip.data import write_toy_dataset

    root = tmp_path_factory.mktemp("full_disk_data")
    write_toy_dataset(root, num_train=64, num_val=8, num_zeroshot=8, image_size=32, samples_per_shard=16)
    return root


def test_a_save_that_cannot_be_written_leaves_the_last_checkpoint_intact(data, tmp_path):
    out = tmp_path / "run"
    first = Run(train_args(data, out, "train.steps=4", "train.save_every_steps=4"), tmp_path / "first.log")
    assert first.wait() == 0, first.text()[-4000:]
    assert last_complete(out) == 4
    before = sorted(p.name for p in (out / "checkpoints").iterdir())

    sets = ["train.steps=8", "train.save_every_steps=4"]
    full = Run([*train_args(data, out, *sets), "--resume", "latest"], tmp_path / "full.log", limit_file_size)
    processes = full.processes()
    started = time.monotonic()
    code = full.wait()
    all_gone(processes, timeout=60)
    print(f"the failed save stopped the run with {code} {time.monotonic() - started:.1f} s after its start")
    text = full.text()
    assert code == 4, text[-4000:]
    line = next(line for line in text.splitlines() if "eva-fastclip train: stopped: saving " in line)
    assert f"saving {out / 'checkpoints' / checkpoint.tag_for_step(8)} failed (rank " in line
    assert "this process may write at most 2.0 MiB to a file (RLIMIT_FSIZE, ulimit -f)" in line
    assert f"the last complete checkpoint, {out / 'checkpoints' / checkpoint.tag_for_step(4)}, takes" in line
    assert "are left on the file system" in line and "--resume latest" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # no staging folder left
    assert checkpoint.resolve_resume("latest", out / "checkpoints").name == checkpoint.tag_for_step(4)

    again = Run([*train_args(data, out, *sets), "--resume", "latest"], tmp_path / "again.log")
    assert again.wait() == 0, again.text()[-4000:]
    assert last_complete(out) == 8
