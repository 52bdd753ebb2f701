"""train.save_every_minutes: a checkpoint whenever that much time has passed since the last one, decided
by rank 0's clock at a step boundary (the 2-rank agreement is in tests/test_preemption.py)."""

import json
import time
from pathlib import Path

import torch

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.config import load_config
from eva_fastclip.engine.build import build_trainer

SECONDS = 0.6  # train.save_every_minutes=0.01


class SlowBatches:
    """8 batches of 8 pairs an epoch, each 0.15 s in coming: the steps take a known least time."""

    num_batches, dataset_size, num_samples = 8, 64, 64

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for t in range(self.num_batches):
            time.sleep(0.15)
            yield (
                torch.randn(8, 3, 32, 32, generator=g),
                torch.randint(1, 49000, (8, 16)),
                torch.arange(8) + 8 * t,
            )


def test_checkpoints_come_by_time(tmp_path):
    ds = json.loads(Path("ds_configs/zero1_fp32_lamb.json").read_text())
    cfg = load_config(
        "configs/toy.json",
        [
            "model.name=test-vit-xs",
            "train.batch_size=8",
            "train.steps=14",
            "train.save_every_minutes=0.01",
            "train.keep_checkpoints=100",
            f"train.output_dir={tmp_path}",
            "eval.zeroshot_dir=null",
            "eval.retrieval_shards=null",
        ],
    )
    started = time.time()
    build_trainer(cfg, ds, loader=SlowBatches()).train()
    folders = checkpoint.complete_checkpoints(tmp_path / "checkpoints")
    done = [(folder / checkpoint.MARKER).stat().st_mtime for folder in folders]
    steps = [int(folder.name.removeprefix("step_")) for folder in folders]
    assert len(steps) >= 3 and steps[-1] == 14  # by time along the way (>= 2.1 s of steps), and the end
    gaps = [b - a for a, b in zip([started, *done[:-2]], done[:-1])]  # the final save comes by the end
    assert all(gap >= SECONDS for gap in gaps), (steps, gaps)
    assert all(b - a <= 5 for a, b in zip(steps, steps[1:]))  # 0.6 s is at most 4 steps of >= 0.15 s
