"""train.remote_dir (checkpointing/remote_copy.py) against moto's S3 server, started by the test on the
loopback: each complete checkpoint and the logs go up in the background, keep_checkpoints applies there; a
run whose output folder was deleted (a fresh node) resumes with --resume latest from the remote and ends
as the uninterrupted run does; a copy killed midway (SIGKILL, the uploads stalled by the server) is never
chosen; a fresh run on a remote folder with checkpoints is refused before it starts."""

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from stand_ins import MASKED, StandInBatches, toy_config, toy_trainer

from benchmarks.object_store import BUCKET, start_s3
from eva_fastclip.checkpointing.remote_copy import bring_down_latest, remote_checkpoints
from eva_fastclip.data.remote import url_fs
from eva_fastclip.plan import preflight
from eva_fastclip.reliability import remote_lock
from eva_fastclip.reliability.preemption import Preempted
from eva_fastclip.reliability.run_lock import FolderHeld


@pytest.fixture(scope="module")
def s3():
    import boto3

    server = start_s3()
    boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=BUCKET)  # every test's
    yield server
    server.stop()


class StoppedAtBatch(StandInBatches):
    """The stand-in batches, a SIGTERM to this process (a scheduler's stop) as batch ``stop`` is drawn."""

    def __init__(self, stop: int | None) -> None:
        super().__init__(6, 8)
        self.stop = stop

    def __iter__(self):
        for number, batch in enumerate(super().__iter__()):
            if number == self.stop:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch


def run(output_dir, *, remote: str | None, resume: str | None = None, stop: int | None = None):
    """Six steps of the toy model, a save every 2 and at a stop, one kept; the trainer and its last step."""
    sets = ["train.steps=6", "train.save_every_steps=2", "train.keep_checkpoints=1"]
    if remote:
        sets.append(f"train.remote_dir={remote}")
    trainer = toy_trainer(toy_config(output_dir, *MASKED, *sets), loader=StoppedAtBatch(stop), resume=resume)
    with contextlib.suppress(Preempted):
        trainer.train()
    return trainer


def step_losses(output_dir) -> dict[int, float]:
    lines = (output_dir / "train_log.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.engine.module.named_parameters()}


def test_a_fresh_node_resumes_from_the_remote_as_the_run_goes_on(s3, tmp_path):
    remote = f"s3://{BUCKET}/runs/a"
    whole = run(tmp_path / "whole", remote=None)
    stopped = run(tmp_path / "node-1", remote=remote, stop=3).step  # preempted: saved and copied first
    assert 2 < stopped < 6
    fs, root = url_fs(remote)
    assert remote_checkpoints(fs, root) == [f"step_{stopped:08d}"]  # keep_checkpoints=1 there too
    assert fs.exists(f"{root}/train_log.jsonl") and fs.exists(f"{root}/config.json")
    assert fs.find(f"{root}/tensorboard")

    with pytest.raises(preflight.PreflightError, match="holds complete checkpoints of an earlier run"):
        cfg = toy_config(tmp_path / "elsewhere", *MASKED, "train.steps=6", f"train.remote_dir={remote}")
        preflight.raise_for_errors(preflight.check_inputs(cfg, resume=None), log_warnings=False)

    shutil.rmtree(tmp_path / "node-1")  # the node is gone: a fresh one, its output folder empty
    resumed = run(tmp_path / "node-1", remote=remote, resume="latest")
    assert step_losses(tmp_path / "node-1") == pytest.approx(step_losses(tmp_path / "whole"), abs=1e-6)
    theirs, ours = weights(whole), weights(resumed)
    assert all(torch.equal(theirs[name], ours[name]) for name in theirs)
    assert remote_checkpoints(fs, root) == ["step_00000006"]


def test_a_copy_killed_midway_is_never_chosen(s3, tmp_path):
    """A process copying step 8 is SIGKILLed once some of its files are up (each PUT stalled 0.3 s by the
    server): the remote holds step 8's files without its marker, and --resume latest brings step 6 down."""
    remote = f"s3://{BUCKET}/runs/b"
    run(tmp_path / "run", remote=remote)
    fs, root = url_fs(remote)
    assert remote_checkpoints(fs, root) == ["step_00000006"]
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(checkpoints / "step_00000006", tmp_path / "step_00000008")
    copier = textwrap.dedent(f"""
        from pathlib import Path
        from eva_fastclip.checkpointing.remote_copy import RemoteCopy
        RemoteCopy(Path({str(tmp_path / "run")!r}), {remote!r}, keep=5)._copy_checkpoint(
            Path({str(tmp_path / "step_00000008")!r}))
        print("copied whole", flush=True)
    """)
    s3.faults.put_stall_s = 0.3
    try:
        proc = subprocess.Popen([sys.executable, "-c", copier], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not fs.find(f"{root}/checkpoints/step_00000008", refresh=True):
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL and "copied whole" not in proc.stdout.read()
    finally:
        s3.faults.clear()
    fs.invalidate_cache()
    left = fs.find(f"{root}/checkpoints/step_00000008")
    assert left and not any(path.endswith("COMPLETE.json") for path in left)
    assert remote_checkpoints(fs, root) == ["step_00000006"]
    fresh = tmp_path / "fresh" / "checkpoints"
    assert bring_down_latest(remote, fresh) == fresh / "step_00000006"
    assert (fresh / "step_00000006" / "COMPLETE.json").is_file()
    assert (tmp_path / "fresh" / "train_log.jsonl").is_file()  # the logs the fresh folder lacked


def test_one_run_per_remote_folder(s3, monkeypatch, caplog):
    """A remote run lock whose beat count moves (a live run on another node) stops a second run before it
    starts, naming the holder; one whose count stands still for the watch (1.5 s here) is taken over."""
    monkeypatch.setattr(remote_lock, "WATCH_S", 1.5)
    remote = f"s3://{BUCKET}/runs/c"
    fs, root = url_fs(remote)
    record = {"host": "node-9", "pid": 77, "started": 1.0, "beat": 0}
    beating = threading.Event()

    def beat():  # node-9's run, alive
        while not beating.wait(0.3):
            record["beat"] += 1
            fs.pipe_file(f"{root}/run.lock", json.dumps(record).encode())

    fs.pipe_file(f"{root}/run.lock", json.dumps(record).encode())
    beater = threading.Thread(target=beat)
    beater.start()
    try:
        with pytest.raises(FolderHeld, match=r"is held by a live run \(host node-9, pid 77"):
            remote_lock.hold(remote)
    finally:
        beating.set()
        beater.join()
    started = time.monotonic()
    remote_lock.hold(remote)  # node-9 died: its count stood still
    print(f"the dead run's remote lock taken over after {time.monotonic() - started:.1f} s")
    assert "taking over" in caplog.text and "(host node-9, pid 77)" in caplog.text
    assert json.loads(fs.cat_file(f"{root}/run.lock"))["pid"] == os.getpid()
    remote_lock.give_up(remote)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/run.lock")


def test_of_two_runs_taking_a_remote_folder_at_once_one_holds_it(s3, monkeypatch):
    """Two processes take one free remote folder at the same moment (a barrier; each its own S3 client, as
    two nodes): the lock is created only where none is (S3's If-None-Match), so one holds it and the other,
    watching a count that moves, stops naming it. Without the conditional create both wrote the lock and
    both went on."""
    monkeypatch.setattr(remote_lock, "WATCH_S", 1.5)
    monkeypatch.setattr(remote_lock, "HEARTBEAT_S", 0.3)
    remote = f"s3://{BUCKET}/runs/race"
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(2), context.Queue()
    racers = [context.Process(target=_take, args=(remote, start, results)) for _ in range(2)]
    for racer in racers:
        racer.start()
    outcomes = sorted(results.get(timeout=120) for _ in racers)
    for racer in racers:
        racer.join(timeout=30)
    print(f"two runs at once: {outcomes}")
    assert [o.split(":")[0] for o in outcomes] == ["held", "refused"], outcomes
    assert "is held by a live run" in outcomes[1]


def _take(remote: str, start, results) -> None:
    """One racer (a spawned process): take ``remote`` the moment both are ready, hold it 2.5 s (beating)."""
    from eva_fastclip.reliability import remote_lock as lock

    lock.WATCH_S, lock.HEARTBEAT_S = 1.5, 0.3  # (a spawned process imports the module afresh)
    start.wait()
    try:
        lock.hold(remote)
    except FolderHeld as err:
        results.put(f"refused: {err}")
        return
    results.put("held")
    time.sleep(2.5)  # the other's watch (1.5 s) sees the count move
    lock.give_up(remote)
