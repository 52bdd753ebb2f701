"""The run the fault tests share (preemption, stragglers, a full disk, hangs): 2 ranks of the tiny model,
fp32 on CPU, FastCLIP-v3 with patch dropout 0.5, the session's toy data (tests/conftest.py ``toy_data``) with
2 loader workers a rank, 16 pairs a step, 30 steps, no scheduled saves unless a test asks for them."""

from __future__ import annotations

import json
from pathlib import Path

from launching import train_args

from eva_fastclip.checkpointing import checkpoint

STEPS, SIGNAL_AFTER = 30, 5
MODULE = ["--module", "eva_fastclip"]


def fault_args(data: Path, out: Path, *extra: str) -> list[str]:
    """``train ...`` of the shared run into ``out``; ``extra`` settings win."""
    return train_args(
        "model.name=test-vit-xs",
        "model.patch_dropout=0.5",
        "loss.name=fastclip_v3",
        f'data.train_shards=["{data / "train"}"]',
        "data.workers=2",
        "data.shuffle_buffer=10",
        "eval.zeroshot_dir=null",
        "eval.retrieval_shards=null",
        "train.precision=fp32",
        "train.batch_size=8",
        f"train.steps={STEPS}",
        "train.log_every_steps=1",
        f"train.output_dir={out}",
        "optim.warmup_steps=2",
        *extra,
    )


def last_complete(out: Path) -> int:
    """The step of the run's last complete checkpoint."""
    return int(checkpoint.complete_checkpoints(out / "checkpoints")[-1].name.removeprefix("step_"))


def step_log(out: Path) -> list[dict]:
    """The run's train_log.jsonl, one record per optimizer step, without the windows' throughput figures
    (``perf/*``: timings, which differ from run to run)."""
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in record.items() if not k.startswith("perf/")} for record in records]


def straggler_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "straggler(s) hold every step back" in line]
