"""What rank 0 writes as a run goes: its config, the step log, the evaluation log, TensorBoard, the bar.

``output_dir/config.json`` is the run's config (the plan's: what it derived included); ``train_log.jsonl``
has one line per optimizer step (metrics and lr per tower), ``eval_results.jsonl`` one per evaluated step.
A resumed run drops the lines of steps after its checkpoint: it trains those again. Every method is a
no-op on the other ranks but :meth:`RunLog.skipped_samples`, which every rank calls (it sums over them).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eva_fastclip.reliability.process import memory_in_use_gib

log = logging.getLogger(__name__)

#: one line of metrics per optimizer step, in train.output_dir
STEP_LOG = "train_log.jsonl"
EVAL_LOG = "eval_results.jsonl"  # one line per evaluated step, kept as the step log is on resume


class RunLog:
    def __init__(
        self,
        output_dir: Path,
        config: dict[str, Any],
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        total: int,
        main: bool,
    ) -> None:
        self.optimizer, self.main = optimizer, main
        self.writer = None
        self._skips_reported = 0  # skipped samples already reported on the console
        if not main:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / "tensorboard"))
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.json").write_text(json.dumps(config, indent=2))
        self._steps = open_step_log(output_dir / STEP_LOG, step)
        # a finished run resumed evaluates its last step again: that step's line is replaced
        self._evals = open_step_log(output_dir / EVAL_LOG, step - (step >= total))

    def lr_per_tower(self) -> dict[str, float]:
        """One lr per tower (its largest: the head's), not one per layer group."""
        found: dict[str, float] = {}
        for group in self.optimizer.param_groups:
            key = f"lr/{group.get('name', 'group').split('.')[0]}"
            found[key] = max(found.get(key, 0.0), group["lr"])
        return found

    def step(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        """The step log's line of this optimizer step: its metrics and the lr per tower."""
        if not self.main:
            return
        record: dict[str, Any] = {"step": step, "epoch": epoch}
        record.update((k, v) for k, v in metrics.items() if isinstance(v, (int, float)))
        record.update(self.lr_per_tower())
        self._steps.write(json.dumps(record) + "\n")
        self._steps.flush()

    def evaluation(self, record: dict[str, Any]) -> None:
        if self.main:
            self._evals.write(json.dumps(record) + "\n")
            self._evals.flush()

    def scalars(self, metrics: dict[str, float], step: int, prefix: str = "train/") -> None:
        """TensorBoard's scalars; ``train/`` ones with the lr per tower and the memory in use."""
        if not self.main:
            return
        if prefix == "train/":
            metrics = {**metrics, **self.lr_per_tower(), "memory_gib": memory_in_use_gib()}
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(prefix + key, value, step)
        self.writer.flush()

    def skipped_samples(
        self, by_reason: dict[str, int] | None, step: int, device: torch.device, world_size: int
    ) -> dict[str, float]:
        """Samples the loaders skipped so far (``by_reason``: this rank's), summed over ranks, as metrics
        ``data/skipped`` (the total) and ``data/skipped/<reason>``; rank 0 prints a line whenever the
        total has grown. Every rank calls it (a collective)."""
        if by_reason is None:
            return {}
        counts = torch.tensor(list(by_reason.values()), dtype=torch.int64, device=device)
        if world_size > 1:
            dist.all_reduce(counts)
        counts = dict(zip(by_reason, counts.tolist()))
        total = sum(counts.values())
        if self.main and total > self._skips_reported:
            why = ", ".join(f"{reason} {count}" for reason, count in counts.items() if count)
            log.warning(
                "step %d: %d samples skipped so far on %d rank(s) (%s); the loader's warnings name the first",
                step, total, world_size, why,
            )  # fmt: skip
            self._skips_reported = total
        return {"data/skipped": total, **{f"data/skipped/{reason}": n for reason, n in counts.items()}}

    def progress_bar(self, total: int, initial: int):
        from tqdm import tqdm

        return tqdm(
            total=total, initial=initial, disable=not self.main, desc="train", unit="step", dynamic_ncols=True
        )


def open_step_log(path: Path, step: int):
    """The step log for appending, without the lines of steps after ``step``: a resumed run trains those
    again (they were its killed predecessor's) and a fresh run (step 0) starts an empty log."""
    if path.exists():
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):  # a line cut short by a kill
                continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return open(path, "a")
