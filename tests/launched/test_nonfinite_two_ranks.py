"""Non-finite steps on 2 ranks (tests/test_nonfinite.py has one rank): only one rank's loss turns
non-finite, and both stop together."""

import hashlib
import json

import torch
from launching import run_ranks, train_args
from stand_ins import complete_steps

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.export import consolidated_state_dict


def test_two_ranks_stop_together_when_one_ranks_loss_turns_non_finite(tmp_path, rank_pool, toy_data):
    """2 ranks of the rank pool (ZeRO-1, fp32, the session's toy data) where only rank 1's batches of steps
    5-7 hold a NaN image (tests/launched_train.py): both ranks stop at step 7 with exit code 3 and the
    message, nothing is saved after the step-4 checkpoint, and that checkpoint is byte for byte what its
    save wrote and loads with finite weights."""
    out, record = tmp_path / "run", tmp_path / "record"
    sets = {
        "model.name": "test-vit-xs",
        "loss.name": "fastclip_v3",
        "data.train_shards": json.dumps([str(toy_data / "train")]),
        "data.workers": 0,
        "train.deepspeed_config": "ds_configs/zero1_fp32_lamb.json",
        "train.precision": "fp32",
        "train.batch_size": 8,
        "train.steps": 12,
        "train.save_every_steps": 4,
        "train.max_skipped_steps": 3,
        "train.hang_timeout_s": 0,
        "train.output_dir": str(out),
        "optim.warmup_steps": 1,
        "eval.zeroshot_dir": "null",
        "eval.retrieval_shards": "null",
    }
    args = train_args(*(f"{key}={value}" for key, value in sets.items()))
    hooks = {"EVA_TEST_POISON": "1:5,6,7", "EVA_TEST_RECORD": str(record)}
    program = ["tests/launched_train.py", *args]
    text = run_ranks(2, program, tmp_path / "launch.log", pool=rank_pool, env=hooks, expect=3)

    last = out / "checkpoints" / checkpoint.tag_for_step(4)
    ranks = [json.loads((record / f"rank_{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        assert rank["exit_code"] == 3 and rank["step"] == 7, rank
        assert "step 7: 3 optimizer steps in a row (steps 5-7) were skipped" in rank["message"]
        assert f"the last complete checkpoint, {last}, is intact" in rank["message"]
    assert "eva-fastclip train: stopped: step 7: " in text  # rank 0 says it on the console
    assert complete_steps(tmp_path / "run") == [4]  # the first one (step 4) is the only one, as saved
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == [last.name]  # nor a partial one
    saved = json.loads((record / "saved_4.json").read_text())
    files = sorted(path for path in last.rglob("*") if path.is_file())
    assert {str(p.relative_to(last)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files} == saved
    assert checkpoint.read_marker(last)["step"] == 4
    weights = consolidated_state_dict(last)
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())
