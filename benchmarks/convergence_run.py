"""One run of the convergence benchmark, in a process of its own: the in-memory loader and its crop, the
real ``Trainer``, the curves read back from its TensorBoard events, and the result files on disk (a finished
run's ``results/<name>.json``, which a restarted benchmark skips).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import resource
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.convergence_grid import METRICS, RunSpec


class MemoryLoader:
    """The training split decoded and tokenised once, held as tensors: what ``Trainer`` needs of a loader.

    Decoding and tokenising in the loop (``TrainLoader``) took more CPU than the tiny model's step. Each
    epoch is a fresh permutation seeded by (seed, epoch), every sample once; each optimizer step's pairs
    get open_clip's training crop (``RandomResizedCrop``, area 0.9-1, aspect 3/4-4/3), done on tensors by
    one grid_sample, and leave as ``micro_batches`` micro-batches of ``batch_size``: the same pairs and
    crops however a step is split. Indices and the per-sample table's size are read as ``TrainLoader`` reads
    them (``.json[index_key]``, the shards' size records).
    """

    def __init__(
        self,
        source: Path,
        *,
        preprocess,
        tokenize,
        batch_size: int,
        seed: int,
        index_key: str = "key",
        micro_batches: int = 1,
    ) -> None:
        import torch
        import webdataset as wds

        from eva_fastclip.data import expand_urls, resolve_sizes
        from eva_fastclip.data.tar_reader import parse_index

        urls = expand_urls(str(source))
        sizes = resolve_sizes(urls, index_key=index_key)
        pipeline = wds.DataPipeline(
            wds.SimpleShardList(urls),
            wds.tarfile_to_samples(),
            wds.decode("pil"),
            wds.to_tuple("png;jpg;jpeg;webp", "txt", "json"),
        )
        images, captions, indices = [], [], []
        for image, caption, meta in pipeline:
            index = parse_index(meta.get(index_key))
            if index is None or index >= sizes.index_size:
                raise ValueError(
                    f"{source}: a sample has {index_key}={meta.get(index_key)!r}, not an index in "
                    f"[0, {sizes.index_size}) ({sizes.index_size_from}); convert the data again"
                )
            images.append(preprocess(image))
            captions.append(caption.splitlines()[0])
            indices.append(index)
        if len(indices) != sizes.num_samples:
            raise ValueError(
                f"{source} holds {len(indices)} samples, its {sizes.num_samples_from} says "
                f"{sizes.num_samples}: convert the data again"
            )
        self.images = torch.stack(images)
        self.tokens = tokenize(captions)
        self.indices = torch.tensor(indices, dtype=torch.int64)
        self.dataset_size = sizes.index_size
        self.num_samples = len(indices)
        self.micro_batches = micro_batches
        self.num_batches = self.num_samples // (batch_size * micro_batches) * micro_batches
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.num_samples, generator=generator)
        step, b = self.batch_size * self.micro_batches, self.batch_size
        for start in range(0, self.num_batches * b, step):
            pairs = order[start : start + step]
            images = random_resized_crop(self.images[pairs], generator)
            for t in range(self.micro_batches):
                micro = pairs[t * b : (t + 1) * b]
                yield images[t * b : (t + 1) * b], self.tokens[micro], self.indices[micro]


def random_resized_crop(images, generator, scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3)):
    """A random crop of each image (area fraction in ``scale``, aspect in ``ratio``) resized to full size."""
    import torch
    import torch.nn.functional as F

    n = len(images)
    area = torch.empty(n).uniform_(*scale, generator=generator)
    aspect = torch.exp(torch.empty(n).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator))
    width = torch.sqrt(area * aspect).clamp(max=1.0)  # fractions of the side
    height = torch.sqrt(area / aspect).clamp(max=1.0)
    # crop centre, in grid_sample's [-1, 1] coordinates, anywhere the crop stays inside the image
    cx = (torch.rand(n, generator=generator) * 2 - 1) * (1 - width)
    cy = (torch.rand(n, generator=generator) * 2 - 1) * (1 - height)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = width, cx, height, cy
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


def run_one(spec: RunSpec, data_dir: Path, out_dir: Path, threads: int) -> dict[str, Any]:
    """Train and evaluate one run in this process, write ``results/<name>.json``; returns the record.

    The benchmark gives every run a process of its own (:func:`run_in_child`); the run's folder must hold
    no run yet.
    """
    import torch

    from eva_fastclip.config import load_config
    from eva_fastclip.engine.build import build_trainer
    from eva_fastclip.models import create_model
    from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

    run_dir = out_dir / "runs" / spec.name
    start = time.perf_counter()
    cfg = load_config(None, spec.overrides(data_dir, run_dir))
    bundle = create_model(cfg.model)
    loader = MemoryLoader(
        data_dir / "train",
        preprocess=bundle.preprocess_eval,  # the crop is the loader's: one resize to the model's size here
        tokenize=bundle.tokenizer,
        batch_size=spec.batch // spec.accumulate,
        seed=spec.seed,
        index_key=cfg.data.index_key,
        micro_batches=spec.accumulate,
    )
    trainer = build_trainer(cfg, load_deepspeed_config(cfg.train.deepspeed_config), loader=loader)
    torch.set_num_threads(threads)  # the Trainer gives one rank all cores; parallel runs share them
    trainer.evaluate()  # the untrained model: the curves start at epoch 0
    final = trainer.train()
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # only the metrics are kept
    scalars = read_scalars(run_dir / "tensorboard")
    record = {
        "spec": asdict(spec),
        "steps_per_epoch": spec.steps_per_epoch,
        "total_steps": trainer.total_steps,
        "curves": curves_from_scalars(scalars, spec.steps_per_epoch),
        "final": final,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,  # the process's own work, whatever else ran beside it
        "threads": threads,
        "finished": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    write_json(out_dir / "results" / f"{spec.name}.json", record)
    return record


def run_in_child(spec: RunSpec, data_dir: Path, out_dir: Path, threads: int) -> dict[str, Any]:
    """One run in the benchmark's worker process, in a fresh folder, everything it prints in its train.log."""
    try:
        run_dir = out_dir / "runs" / spec.name
        if run_dir.exists():  # a run cut short: start it again from scratch
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        stream = open(run_dir / "train.log", "w", buffering=1)  # noqa: SIM115 (lives as long as the process)
        os.dup2(stream.fileno(), sys.stdout.fileno())
        os.dup2(stream.fileno(), sys.stderr.fileno())
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_one(spec, data_dir, out_dir, threads)
    except BaseException as err:  # the parent sees the message; the traceback is in the run's train.log
        import traceback

        traceback.print_exc()
        log_file = out_dir / "runs" / spec.name / "train.log"
        raise RuntimeError(f"{spec.name} failed: {err!r} (see {log_file})") from None


def read_scalars(tensorboard_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} over every event file of a run (a later value at the same step wins)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for events in sorted(Path(tensorboard_dir).glob("events.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return scalars


def curves_from_scalars(scalars: dict[str, dict[int, float]], steps_per_epoch: int) -> dict[str, Any]:
    """The evaluation curves and the temperature, against epochs."""
    missing = [f"eval/{key}" for key in METRICS if f"eval/{key}" not in scalars]
    if missing:
        raise ValueError(f"the run logged no {missing}: was evaluation configured?")
    steps = sorted(scalars["eval/zeroshot_top1"])
    curves: dict[str, Any] = {"epoch": [s / steps_per_epoch for s in steps]}
    for key in METRICS:
        curves[key] = [scalars[f"eval/{key}"][s] for s in steps]
    # a global temperature (openclip, v1, v3, sogclr) or the median of the individual ones (isogclr)
    tag = next((t for t in ("train/temperature", "train/temperature_q50") if t in scalars), None)
    if tag is not None:
        tau_steps = sorted(scalars[tag])
        curves["temperature_epoch"] = [s / steps_per_epoch for s in tau_steps]
        curves["temperature"] = [scalars[tag][s] for s in tau_steps]
    return curves


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)  # a result file exists only complete: the resume check relies on it


def load_results(out_dir: Path, specs: list[RunSpec]) -> tuple[list[dict[str, Any]], list[RunSpec]]:
    """(records of finished runs, specs still to run). A record made with other settings stops it."""
    done, todo = [], []
    for spec in specs:
        path = out_dir / "results" / f"{spec.name}.json"
        if not path.is_file():
            todo.append(spec)
            continue
        record = json.loads(path.read_text())
        record["spec"] = {**_SPEC_DEFAULTS, **record["spec"]}  # from before a key existed: its default
        wanted = asdict(spec)
        if record["spec"] != wanted:
            keys = sorted(record["spec"].keys() | wanted.keys())
            changed = {
                k: (record["spec"].get(k), wanted.get(k))
                for k in keys
                if record["spec"].get(k) != wanted.get(k)
            }
            raise ValueError(
                f"{path} was made with other settings {changed} (saved, requested): use another --output, "
                "or delete the results folder to start again"
            )
        done.append(record)
    return done, todo


_SPEC_DEFAULTS = {"accumulate": 1, "contrastive": "micro"}
