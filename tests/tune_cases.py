"""What the tune tests share (tests/test_tune.py, tests/launched/test_tune_two_ranks.py): the toy config's
overrides for a search over toy shards."""

from pathlib import Path

REPO = Path(__file__).parents[1]
MIB = 2**20


def toy_overrides(toy: Path, out: Path, global_batch: int = 64) -> list[str]:
    return [
        f'data.train_shards=["{toy / "train"}"]',
        "data.workers=1",
        "train.batch_size=null",
        f"train.global_batch={global_batch}",
        f"train.output_dir={out}",
        "train.precision=fp32",  # auto is bf16 on a CPU that computes it: the memory model was fitted in fp32
    ]
