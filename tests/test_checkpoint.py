"""Checkpoint bookkeeping: only marked folders count; a save that dies at any point never leaves less than
one complete checkpoint; every file is on disk before the marker; the save that completed last is the
latest."""

import json
import os
import shutil

import pytest

from eva_fastclip.checkpointing import checkpoint


class FakeWriter:
    """DeepSpeed's checkpoint engine: every file and folder of its save goes through it."""

    def save(self, content, path):
        checkpoint.Path(path).write_bytes(content)

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)


class FakeEngine:
    """Writes files the way DeepSpeed does; can die after the first one."""

    def __init__(self, die=False, content=b"weights"):
        self.die, self.content = die, content
        self.checkpoint_engine = FakeWriter()

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False  # DeepSpeed's own 'latest' would point at unfinished saves
        folder = checkpoint.Path(save_dir) / tag
        self.checkpoint_engine.makedirs(folder, exist_ok=True)
        self.checkpoint_engine.save(self.content, folder / "mp_rank_00_model_states.pt")
        if self.die:
            raise KeyboardInterrupt("killed while writing the optimizer shards")
        self.checkpoint_engine.save(b"optimizer", folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def extra(folder):
    (folder / "per_sample").mkdir()
    (folder / "per_sample" / "per_sample_000000000000-000000000010.pt").write_bytes(b"u")


def weights(folder):
    return (folder / "mp_rank_00_model_states.pt").read_bytes()


def test_only_complete_checkpoints_are_resumed(tmp_path):
    root = tmp_path / "checkpoints"
    assert checkpoint.resolve_resume("latest", root) is None  # nothing yet: start from scratch
    assert checkpoint.resolve_resume(None, root) is None

    first = checkpoint.save_checkpoint(FakeEngine(), root, 100, {}, keep=2)
    assert first.name == "step_00000100"
    assert json.loads((first / checkpoint.MARKER).read_text())["step"] == 100

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(FakeEngine(die=True), root, 200, {}, keep=2)
    assert (root / "step_00000200.saving").is_dir()  # the torn save is there ...
    assert checkpoint.resolve_resume("latest", root) == first  # ... but resume ignores it
    with pytest.raises(ValueError, match="save never finished"):
        checkpoint.resolve_resume(str(root / "step_00000200.saving"), root)
    with pytest.raises(FileNotFoundError):
        checkpoint.resolve_resume(str(root / "step_00000300"), root)
    checkpoint.recover(root)  # what the next run's rank 0 does first
    assert sorted(p.name for p in root.iterdir()) == ["step_00000100"]

    again = checkpoint.save_checkpoint(FakeEngine(), root, 200, {}, keep=2)
    assert checkpoint.resolve_resume("latest", root) == again
    assert (again / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()


def test_every_file_and_folder_is_synced_before_the_marker(tmp_path, monkeypatch):
    synced, marked = [], []
    real_fsync, real_write = checkpoint._fsync, checkpoint.write_json_atomic
    monkeypatch.setattr(checkpoint, "_fsync", lambda path: (synced.append(path), real_fsync(path)))
    monkeypatch.setattr(
        checkpoint,
        "write_json_atomic",
        lambda path, payload: (marked.append(len(synced)), real_write(path, payload)),
    )
    root = tmp_path / "checkpoints"
    final = checkpoint.save_checkpoint(FakeEngine(), root, 5, {}, keep=2, write_extra=extra)
    before_marker = {p.relative_to(root / "step_00000005.saving") for p in synced[: marked[0]]}
    on_disk = {p.relative_to(final) for p in final.rglob("*") if p.name != checkpoint.MARKER}
    assert on_disk and on_disk | {checkpoint.Path(".")} == before_marker  # every file, every folder
    assert root in synced[marked[0] :]  # the rename into place is synced too


class RefusedEngine(FakeEngine):
    """Its first write is refused by the OS (a folder that does not exist); DeepSpeed's save goes on to its
    end, where it waits at a barrier for every rank."""

    reached_the_end = False

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        folder = checkpoint.Path(save_dir) / tag
        self.checkpoint_engine.makedirs(folder, exist_ok=True)
        self.checkpoint_engine.save(b"weights", folder / "absent" / "mp_rank_00_model_states.pt")
        self.checkpoint_engine.save(b"optimizer", folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        self.reached_the_end = True


def test_a_refused_write_fails_the_save_without_leaving_deepspeeds_save_early(tmp_path):
    root = tmp_path / "checkpoints"
    first = checkpoint.save_checkpoint(FakeEngine(), root, 1, {}, keep=2)
    engine = RefusedEngine()
    with pytest.raises(checkpoint.CheckpointWriteError) as raised:
        checkpoint.save_checkpoint(engine, root, 2, {}, keep=2, write_extra=extra)
    message = str(raised.value)
    assert f"saving {root / 'step_00000002'} failed (rank 0: [Errno 2] No such file or directory" in message
    assert "; 1 of 1 rank(s) failed); the last complete checkpoint, " in message
    assert engine.reached_the_end  # every rank reaches DeepSpeed's last barrier
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # the staging folder is gone
    assert checkpoint.resolve_resume("latest", root) == first
    assert vars(engine.checkpoint_engine) == {}  # DeepSpeed's writer is its own again


def test_saving_a_step_again_never_leaves_it_without_a_complete_checkpoint(tmp_path, monkeypatch):
    """A rerun saves a step that an earlier run saved too. A crash at any filesystem operation of that
    save leaves a complete checkpoint of the step (the old one or the new one), and once rank 0 has
    recovered, the new one if its marker was written."""
    real = {"replace": os.replace, "rmtree": shutil.rmtree, "write": checkpoint.write_json_atomic}

    def crashing(name, calls, crash_at):
        def call(*args, **kwargs):
            calls.append(name)
            if len(calls) == crash_at:
                raise KeyboardInterrupt(f"killed at {name}")
            return real[name](*args, **kwargs)

        return call

    crash_at = 1
    while True:
        root = tmp_path / f"run{crash_at}" / "checkpoints"
        checkpoint.save_checkpoint(FakeEngine(content=b"old"), root, 7, {}, keep=2)
        (root / "step_00000007.saving").mkdir()  # a torn save of the step from a still earlier crash
        calls = []
        monkeypatch.setattr(checkpoint.os, "replace", crashing("replace", calls, crash_at))
        monkeypatch.setattr(checkpoint.shutil, "rmtree", crashing("rmtree", calls, crash_at))
        monkeypatch.setattr(checkpoint, "write_json_atomic", crashing("write", calls, crash_at))
        try:
            checkpoint.save_checkpoint(FakeEngine(content=b"new"), root, 7, {}, keep=2)
            crashed = False
        except KeyboardInterrupt:
            crashed = True
        monkeypatch.undo()
        final, staged = root / "step_00000007", root / "step_00000007.saving"
        new_is_complete = checkpoint.is_complete(staged) or (final.exists() and weights(final) == b"new")
        if crashed:  # before recovery the old or the new one is in place, or the new one is still staged
            assert checkpoint.is_complete(final) or checkpoint.is_complete(staged)
        checkpoint.recover(root)
        assert checkpoint.resolve_resume("latest", root) == final
        assert weights(final) == (b"new" if new_is_complete else b"old"), calls
        assert sorted(p.name for p in root.iterdir()) == ["step_00000007"]
        if not crashed:
            break
        crash_at += 1
    # the torn staging folder's removal, the marker (its rename), the two renames, the old folder's removal
    assert calls == ["rmtree", "write", "replace", "replace", "replace", "rmtree"]


def test_latest_is_the_save_that_completed_last(tmp_path):
    """A rerun into the same output_dir: its checkpoints supersede the earlier run's, even at lower steps,
    and retention removes the earlier run's first."""
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30):  # the earlier run
        checkpoint.save_checkpoint(FakeEngine(content=b"earlier"), root, step, {}, keep=3)
    checkpoint.save_checkpoint(FakeEngine(content=b"rerun"), root, 10, {}, keep=3)
    assert checkpoint.resolve_resume("latest", root) == root / "step_00000010"
    assert weights(root / "step_00000010") == b"rerun"
    checkpoint.save_checkpoint(FakeEngine(content=b"rerun"), root, 20, {}, keep=2)
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_00000010", "step_00000020"]
    assert not (root / "step_00000030").exists()


def test_retention_deletes_only_older_complete_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        checkpoint.save_checkpoint(FakeEngine(), root, step, {}, keep=2)
        checkpoint.universal_folder(root / checkpoint.tag_for_step(step)).mkdir()  # a conversion of it
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_00000030", "step_00000040"]
    names = ["step_00000030", "step_00000030.universal", "step_00000040", "step_00000040.universal"]
    assert sorted(p.name for p in root.iterdir()) == names
    checkpoint.save_checkpoint(FakeEngine(), root, 40, {}, keep=2)  # replacing a step drops its conversion
    assert not checkpoint.universal_folder(root / "step_00000040").exists()


def test_markers_without_a_sequence_sort_by_step_not_by_name(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (9, 100000000, 10):  # a 9-digit step sorts before 8-digit ones as text
        folder = checkpoint.save_checkpoint(FakeEngine(), root, step, {}, keep=5)
        marker = json.loads((folder / checkpoint.MARKER).read_text())
        del marker["sequence"]  # as checkpoints saved before the sequence existed
        (folder / checkpoint.MARKER).write_text(json.dumps(marker))
    assert checkpoint.resolve_resume("latest", root).name == "step_100000000"
    newer = checkpoint.save_checkpoint(FakeEngine(), root, 11, {}, keep=5)
    assert checkpoint.resolve_resume("latest", root) == newer


def test_atomic_json_leaves_no_temporary(tmp_path):
    target = tmp_path / "marker.json"
    checkpoint.write_json_atomic(target, {"a": 1})
    checkpoint.write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["marker.json"]


def test_the_settings_a_checkpoint_was_trained_with(tmp_path):
    """A resumed run compares its config with these: from the marker; for a checkpoint saved before the
    marker held them, from our client state and DeepSpeed's copy of its JSON in the model states."""
    import torch

    config = {"optim": {"lr": 0.001}, "model": {"name": "toy-vit-t"}}
    root = tmp_path / "checkpoints"
    deepspeed = {"optimizer": {"type": "Lamb", "params": {}}, "gradient_clipping": 1.0}
    marked = checkpoint.save_checkpoint(
        FakeEngine(), root, 1, {}, keep=3, marker={"config": config, "deepspeed": deepspeed}
    )
    assert checkpoint.saved_settings(marked) == {"config": config, "deepspeed": deepspeed}

    class OlderEngine(FakeEngine):
        def save_checkpoint(self, save_dir, tag, client_state, save_latest):
            folder = checkpoint.Path(save_dir) / tag
            folder.mkdir(parents=True)
            ds_config = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}
            torch.save(
                {"module": {}, "config": config, "ds_config": ds_config},
                folder / "mp_rank_00_model_states.pt",
            )

    older = checkpoint.save_checkpoint(OlderEngine(), root, 2, {}, keep=3)
    want = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}
    assert checkpoint.saved_settings(older) == {"config": config, "deepspeed": want}


def test_a_failed_saves_report_never_hides_the_error_it_carries(tmp_path):
    """The report a failed save sends to the other ranks runs before that collective: it may not raise.
    A root this node never made (another node's file system) or a damaged marker left the rank out of the
    collective with its own FileNotFoundError instead of the write's error (and the run exited 2)."""
    error = "rank 1: [Errno 13] Permission denied: '/shared/run/checkpoints/step_00000008.saving'"
    never_made = tmp_path / "on another node" / "checkpoints"
    assert checkpoint._failure_report(error, never_made) == (
        error,
        f"what is left on the file system of {never_made} cannot be read here ([Errno 2] No such file or "
        f"directory: '{never_made}')",
    )
    root = tmp_path / "checkpoints"
    (root / "step_00000004").mkdir(parents=True)
    (root / "step_00000004" / checkpoint.MARKER).write_text("")  # a marker cut short
    carried, details = checkpoint._failure_report(error, root)
    assert carried == error and "COMPLETE.json is not valid JSON" in details
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"failed \(rank 1: \[Errno 13\] Permission"):
        checkpoint._raise_if_a_rank_failed([error], never_made, never_made / "step_00000008.saving")
