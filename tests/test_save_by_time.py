"""train.save_every_minutes: a checkpoint whenever that much time has passed since the last one, decided
by rank 0's clock at a step boundary (the 2-rank agreement is in tests/launched/test_preemption.py)."""

import time

from stand_ins import StandInBatches, toy_config, toy_trainer

from eva_fastclip.checkpointing import checkpoint

SECONDS = 0.6  # train.save_every_minutes=0.01


class SlowBatches(StandInBatches):
    """StandInBatches (8 of 8 pairs) whose every batch takes 0.15 s to come, the reason for a class of its
    own: the steps take a known least time."""

    def __init__(self) -> None:
        super().__init__(8, 8, indices="chunks")

    def __iter__(self):
        for batch in self.batches:
            time.sleep(0.15)
            yield batch


def test_checkpoints_come_by_time(tmp_path):
    cfg = toy_config(
        tmp_path,
        "train.batch_size=8",
        "train.steps=10",
        "train.save_every_minutes=0.01",
        "train.keep_checkpoints=100",
        "train.deepspeed_config=ds_configs/zero1_fp32_lamb.json",
    )
    started = time.time()
    toy_trainer(cfg, loader=SlowBatches()).train()
    folders = checkpoint.complete_checkpoints(tmp_path / "checkpoints")
    done = [(folder / checkpoint.MARKER).stat().st_mtime for folder in folders]
    steps = [int(folder.name.removeprefix("step_")) for folder in folders]
    assert len(steps) >= 3 and steps[-1] == 10  # by time along the way (>= 1.5 s of steps), and the end
    gaps = [b - a for a, b in zip([started, *done[:-2]], done[:-1])]  # the final save comes by the end
    assert all(gap >= SECONDS for gap in gaps), (steps, gaps)
    assert all(b - a <= 5 for a, b in zip(steps, steps[1:]))  # 0.6 s is at most 4 steps of >= 0.15 s
