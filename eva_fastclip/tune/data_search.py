"""tune's data step: the fewest loader workers per rank (and the decode) that keep the chosen layout's
data wait under 5%, measured on the real loader (tune/probe.py's ``data_probe``), or what it would take."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from eva_fastclip.config import ExperimentConfig
from eva_fastclip.tune.layouts import Trial

log = logging.getLogger(__name__)

#: the data wait tune aims under, as a fraction of step time
DATA_WAIT_TARGET = 0.05


@dataclasses.dataclass
class DataSearch:
    cfg: ExperimentConfig
    ds: dict[str, Any]
    world_size: int
    rank: int
    scratch: str
    watchdog: Any = None
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the search found that the user should read (a loader that cannot keep up)."""
    not_measured: list[str] = dataclasses.field(default_factory=list)

    def run(self, chosen: Trial) -> dict[str, Any]:
        """The workers and decode for ``chosen``, every run measured, and the one chosen."""
        from eva_fastclip.reliability.data_wait import cores_per_rank, workers_needed

        cores, decode = cores_per_rank(), self.cfg.data.image_decode
        runs: list[dict[str, Any]] = []
        workers, statement = 1, None
        while True:
            result = self._measure(chosen, workers, decode)
            runs.append(dataclasses.asdict(result))
            if result.data_wait <= DATA_WAIT_TARGET or len(runs) >= 4:
                break
            needed = workers_needed(result.data_wait, workers)
            if needed is None or needed > cores:
                statement = self._cannot_keep_up(result.data_wait, workers, needed, cores)
                break
            if len(runs) > 1 and result.samples_per_s <= runs[-2]["samples_per_s"] * 1.05:
                statement = (
                    f"more workers did not speed the loader up ({runs[-2]['workers']} -> {workers} per rank: "
                    f"{runs[-2]['samples_per_s']:.1f} -> {result.samples_per_s:.1f} samples/s): "
                    "storage-bound or CPU-bound"
                )
                break
            workers = max(needed, workers + 1)
        best = min(runs, key=lambda r: (r["data_wait"] > DATA_WAIT_TARGET, r["workers"]))
        if torch.cuda.is_available() and decode == "workers" and best["data_wait"] > DATA_WAIT_TARGET:
            gpu = dataclasses.asdict(self._measure(chosen, best["workers"], "gpu"))
            runs.append(gpu)
            if gpu["data_wait"] < best["data_wait"]:
                best = gpu
        elif not torch.cuda.is_available():
            self.not_measured.append("data.image_decode=gpu: no CUDA device here")
        chosen.data_wait = best["data_wait"]
        if statement and best["data_wait"] > DATA_WAIT_TARGET:
            self.notes.append(statement)
        return {
            "workers": best["workers"],
            "image_decode": best["image_decode"],
            "runs": runs,
            "chosen": best,
        }

    def _cannot_keep_up(self, wait: float, workers: int, needed: int | None, cores: int) -> str:
        ranks = self.world_size
        return (
            f"the loader cannot keep up: at {workers} worker(s) per rank training waited {wait:.0%} of the "
            f"time, and keeping up would take {'more than ' + str(cores) if needed is None else needed} "
            f"workers per rank ({'?' if needed is None else needed * ranks} cores for {ranks} rank(s)), more "
            f"than the {cores} cores per rank here: the run is CPU- or storage-bound (cheaper samples: "
            "smaller images in the shards"
            + (", or data.image_decode=gpu" if torch.cuda.is_available() else "")
            + ")"
        )

    def _measure(self, chosen: Trial, workers: int, decode: str):
        from eva_fastclip.tune.probe import data_probe

        if self.rank == 0:
            log.info("data: %d worker(s) per rank, decode on %s", workers, decode)
        if self.watchdog is not None:
            self.watchdog.set_phase("start-up", 0)
        result = data_probe(
            self.cfg,
            self.ds,
            chosen.candidate,
            workers=workers,
            image_decode=decode,
            output_dir=self.scratch,
            watchdog=self.watchdog,
        )
        if self.rank == 0:
            log.info(
                "  data wait %.1f%%, %.1f samples/s end to end", 100 * result.data_wait, result.samples_per_s
            )
        return result
