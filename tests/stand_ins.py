"""Stand-ins the in-process tests share: seeded batches in place of the webdataset loader, the toy config
with the tiny model, and its Trainer (built as every run is: eva_fastclip.engine.build)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.config import ExperimentConfig, load_config
from eva_fastclip.engine.build import build_trainer
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

#: configs/toy.json's tiny model, no evaluation, fp32 (the same numbers on every CPU)
TINY = (
    "model.name=test-vit-xs",
    "eval.zeroshot_dir=null",
    "eval.retrieval_shards=null",
    "train.precision=fp32",
)
#: the compiled runs' (tests/test_compiled.py, tests/launched/test_compiled_two_ranks.py): 50% masking,
#: 8 pairs a rank, a step logged each step, a fast lr
MASKED = (
    *TINY,
    "model.patch_dropout=0.5",
    "train.batch_size=8",
    "train.log_every_steps=1",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
)


def toy_config(output_dir: Path | str, *sets: str, base: Sequence[str] = TINY) -> ExperimentConfig:
    """configs/toy.json with ``base``, the output folder and ``sets`` (later ones win)."""
    return load_config("configs/toy.json", [*base, f"train.output_dir={output_dir}", *sets])


def toy_trainer(cfg: ExperimentConfig, *, loader=None, resume: str | None = None, ds: dict | None = None):
    """The Trainer of ``cfg`` (its DeepSpeed JSON unless ``ds``) in this process."""
    ds = ds if ds is not None else load_deepspeed_config(cfg.train.deepspeed_config)
    return build_trainer(cfg, ds, resume=resume, loader=loader)


class StandInBatches:
    """A loader the Trainer accepts: ``count`` seeded batches of ``batch`` pairs (images, tokens, dataset
    indices), the same every epoch. ``indices``: "perm" (a seeded permutation's first ``batch`` per batch),
    "chunks" (consecutive slices of one permutation: each sample once per epoch) or "arange"."""

    def __init__(
        self,
        count: int = 6,
        batch: int = 8,
        *,
        dataset_size: int = 64,
        image_size: int = 32,
        context_length: int = 16,
        seed: int = 0,
        indices: str = "perm",
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(dataset_size, generator=g) if indices == "chunks" else None
        self.batches = []
        for i in range(count):
            images = torch.randn(batch, 3, image_size, image_size, generator=g)
            tokens = torch.randint(1, 49000, (batch, context_length), generator=g)
            if indices == "perm":
                index = torch.randperm(dataset_size, generator=g)[:batch]
            elif indices == "chunks":
                index = order[i * batch : (i + 1) * batch]
            else:
                index = torch.arange(batch)
            self.batches.append((images, tokens, index))
        self.num_batches, self.dataset_size, self.num_samples = count, dataset_size, dataset_size

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        return iter(self.batches)


class SixBatches:
    num_batches, dataset_size, num_samples = 6, 64, 64

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(6):
            tokens = torch.randint(1, 49000, (8, 16), generator=g)
            yield torch.randn(8, 3, 32, 32, generator=g), tokens, torch.arange(8)


# ---- what a run wrote ------------------------------------------------------------------------------------


def files_of(folder: Path, mtimes: bool = False) -> dict:
    """Every file under ``folder``: its bytes and, with ``mtimes``, its modification time."""
    return {
        str(path.relative_to(folder)): (path.read_bytes(), path.stat().st_mtime_ns if mtimes else None)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def step_log(out: Path) -> list[dict]:
    """The run's train_log.jsonl, one record per optimizer step, without the windows' throughput figures
    (``perf/*``: timings, which differ from run to run)."""
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in record.items() if not k.startswith("perf/")} for record in records]


def complete_steps(out: Path) -> list[int]:
    """The steps of the complete checkpoints under ``out``/checkpoints, oldest first."""
    return [int(p.name.removeprefix("step_")) for p in checkpoint.complete_checkpoints(out / "checkpoints")]
