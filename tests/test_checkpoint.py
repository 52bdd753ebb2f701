"""Checkpoint bookkeeping: only marked folders count; a save that dies mid-way never hides the last good
one."""

import json

import pytest

from eva_fastclip.engine import checkpoint


class FakeEngine:
    """Writes files the way DeepSpeed does; can die after the first one."""

    def __init__(self, die=False):
        self.die = die

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False  # DeepSpeed's own 'latest' would point at unfinished saves
        folder = checkpoint.Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"weights")
        if self.die:
            raise KeyboardInterrupt("killed while writing the optimizer shards")
        (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optimizer")


def test_only_complete_checkpoints_are_resumed(tmp_path):
    root = tmp_path / "checkpoints"
    assert checkpoint.resolve_resume("latest", root) is None  # nothing yet: start from scratch
    assert checkpoint.resolve_resume(None, root) is None

    first = checkpoint.save_checkpoint(FakeEngine(), root, 100, {}, keep=2)
    assert first.name == "step_00000100"
    assert json.loads((first / checkpoint.MARKER).read_text())["step"] == 100

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(FakeEngine(die=True), root, 200, {}, keep=2)
    assert (root / "step_00000200").is_dir()  # the torn save is there ...
    assert checkpoint.resolve_resume("latest", root) == first  # ... but resume ignores it
    with pytest.raises(ValueError, match="save never finished"):
        checkpoint.resolve_resume(str(root / "step_00000200"), root)
    with pytest.raises(FileNotFoundError):
        checkpoint.resolve_resume(str(root / "step_00000300"), root)

    # saving the same step again replaces the torn folder
    again = checkpoint.save_checkpoint(FakeEngine(), root, 200, {}, keep=2)
    assert checkpoint.resolve_resume("latest", root) == again
    assert (again / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()


def test_retention_deletes_only_older_complete_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        checkpoint.save_checkpoint(FakeEngine(), root, step, {}, keep=2)
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step_00000030", "step_00000040"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000030", "step_00000040"]


def test_checkpoints_sort_by_step_not_by_name(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (9, 100000000, 10):  # a 9-digit step sorts before 8-digit ones as text
        checkpoint.save_checkpoint(FakeEngine(), root, step, {}, keep=5)
    assert checkpoint.resolve_resume("latest", root).name == "step_100000000"


def test_atomic_json_leaves_no_temporary(tmp_path):
    target = tmp_path / "marker.json"
    checkpoint.write_json_atomic(target, {"a": 1})
    checkpoint.write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["marker.json"]
