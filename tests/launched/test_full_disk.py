"""A full disk loses nothing (checkpointing/checkpoint.py), provoked for real: the ranks under a file-size
limit (RLIMIT_FSIZE, ``ulimit -f``), so the kernel refuses the checkpoint's large files with EFBIG, as a full
file system refuses them with ENOSPC. The save fails on every rank together, leaves no folder that looks
complete, names the folder, the error and the sizes, and stops the run with code 4; the previous complete
checkpoint and ``latest`` are intact, and a run without the limit resumes from them.

One run of 8 steps, saving every 4, on 2 ranks of the rank pool (no loader workers, no watchdog: neither is
under test), through tests/launched_train.py, which puts rank 1 under the limit once its step-4 save is
complete (``EVA_TEST_LIMIT_FILE_SIZE``, ``EVA_TEST_LIMIT_RANK``). This is the launch that a limit set on
rank 1 from its start, followed by a run of 4 steps without it, would give: the only files that reach the
limit are the checkpoint's, which the ranks write, so the save of step 8 meets EFBIG where it would have; the
runner and launch.py write no file here (the rank pool stands in for them), and a limit from the start
would only have needed a first run without it to make the step-4 checkpoint. A second run fills a real
file system (a tmpfs of its own) before the first save: ENOSPC on every rank.
"""

import json
import subprocess
import time

import psutil
import pytest
from fault_runs import MODULE, fault_args, last_complete
from launching import all_gone, run_ranks

from eva_fastclip.checkpointing import checkpoint

# bytes a process may write to one file: the logs fit, rank 1's ZeRO partition (9 MB) does not
LIMIT = 2 * 2**20
SETS = ["train.steps=8", "train.save_every_steps=4", "data.workers=0", "train.hang_timeout_s=0"]


def test_a_save_that_cannot_be_written_leaves_the_last_checkpoint_intact(toy_data, rank_pool, tmp_path):
    out, record = tmp_path / "run", tmp_path / "record"
    hooks = {
        "EVA_TEST_LIMIT_FILE_SIZE": str(LIMIT),
        "EVA_TEST_LIMIT_RANK": "1",
        "EVA_TEST_RECORD": str(record),
    }
    started = time.monotonic()
    args = ["tests/launched_train.py", *fault_args(toy_data, out, *SETS)]
    full = rank_pool.launch(2, args, tmp_path / "full.log", env=hooks)
    try:
        processes = [psutil.Process(pid) for pid in full.pids]
        code = full.wait(timeout=600)
    finally:
        full.kill()
    all_gone(processes, timeout=60)
    print(f"the failed save stopped the run with {code} {time.monotonic() - started:.1f} s after its start")
    text = full.output()
    assert code == 4, text[-4000:]
    assert full.leftovers == [], full.leftovers  # nothing of the run is left
    assert (record / "saved_4.json").is_file() and not (record / "saved_8.json").exists()
    before = json.loads((record / "listed_4.json").read_text())  # checkpoints/ once step 4 was saved
    line = next(line for line in text.splitlines() if "eva-fastclip train: stopped: saving " in line)
    assert f"saving {out / 'checkpoints' / checkpoint.tag_for_step(8)} failed (rank 1: " in line
    assert "; 1 of 2 rank(s) failed)" in line
    assert "rank 1 may write at most 2.0 MiB to a file (RLIMIT_FSIZE, ulimit -f)" in line
    assert f"the last complete checkpoint, {out / 'checkpoints' / checkpoint.tag_for_step(4)}, takes" in line
    assert "are left on the file system" in line and "--resume latest" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # no staging folder left
    assert last_complete(out) == 4
    assert checkpoint.resolve_resume("latest", out / "checkpoints").name == checkpoint.tag_for_step(4)

    run_ranks(
        2,
        [*MODULE, *fault_args(toy_data, out, *SETS), "--resume", "latest"],
        tmp_path / "again.log",
        pool=rank_pool,
    )
    assert last_complete(out) == 8


def test_a_full_file_system_fails_the_first_save_on_every_rank(toy_data, rank_pool, tmp_path):
    """A real full file system (ENOSPC): the run's output folder on a tmpfs of 64 MiB of its own, which rank
    0 fills as the run starts, all but 32 KiB (tests/launched_train.py ``EVA_TEST_FILL_AT_START``): the
    step logs fit, the step-4 checkpoint does not. Every rank's files are refused, and so is the copy of
    DeepSpeed's recovery script (38 KiB) that rank 0 makes beside the first ZeRO checkpoint of a folder
    outside DeepSpeed's checkpoint writer: the run stops with code 4, naming the space left (no checkpoint
    yet whose size to compare it with), no checkpoint folder left. (With only the writer's writes recorded,
    rank 0 crashed with the copy's OSError; before any was, it left DeepSpeed's save while rank 1 waited in
    its last barrier: a hang.)"""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", small], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs of its own here (root and CAP_SYS_ADMIN): {mounted.stderr.decode().strip()}")
    try:
        out = small / "run"
        started = time.monotonic()
        args = ["tests/launched_train.py", *fault_args(toy_data, out, *SETS)]
        full = rank_pool.launch(2, args, tmp_path / "full.log", env={"EVA_TEST_FILL_AT_START": str(2**15)})
        try:
            code = full.wait(timeout=600)
        finally:
            full.kill()
        took = time.monotonic() - started
        print(f"the full file system stopped the run with {code} {took:.1f} s after its start")
        text = full.output()
        assert code == 4, text[-4000:]
        line = next(line for line in text.splitlines() if "eva-fastclip train: stopped: saving " in line)
        assert f"saving {out / 'checkpoints' / checkpoint.tag_for_step(4)} failed (rank " in line
        assert "there is no complete checkpoint yet" in line and "the file system is full" not in line
        assert "--resume latest" in line
        assert [p.name for p in (out / "checkpoints").iterdir() if p.is_dir()] == []  # no staging folder left
    finally:
        subprocess.run(["umount", "--lazy", small], check=False)
