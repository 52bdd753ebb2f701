"""DataComp's 38 zero-shot tasks, the benchmark the FastCLIP paper reports, on what DataComp's
``download_evalsets.py`` leaves under a local datasets root (nothing is downloaded).

The task table is DataComp's ``tasklist.yml`` (github.com/mlfoundations/datacomp at commit
4a8df1992566ef8334773f7152e1855b1f716162): key, name and main metric of each task, written out here once
because no installed package ships it. Its FairFace and UTKFace entries have no main metric in DataComp's
results (its aggregate drops them), which leaves the 38 tasks below.

Folders: DataComp's ``download_evalsets.py`` names a task's folder ``wds_<key, "/" as "-">_test`` (the
fairness tasks without their "fairness/" prefix); clip_benchmark's hub copies are ``wds_<key>``; either is
found, and must have clip_benchmark's ``test/nshards.txt``. DataComp reads Flickr, MSCOCO and WinoGAViL
from Hugging Face datasets (nlphuji), which its download caches in ``<root>/hf_cache``: they are read from
there (hf_cache.py, winogavil.py), and Flickr and MSCOCO otherwise from clip_benchmark's retrieval folders
of the same test splits (``wds_flickr30k``: Karpathy's 1k, ``wds_mscoco_captions``: Karpathy's 5k).

Main metrics as DataComp's evaluation computes them: ``acc1``; ``mean_per_class_recall`` (balanced
accuracy); ``mean_recall@1`` (the mean of image and text retrieval R@1); ``F1-macro_all`` (iWildCam: macro
F1 over the labels present); ``acc_worst_region`` (FMoW: the lowest accuracy over the regions present,
metadata column 0); ``acc_top5_wg`` (Dollar Street: the lowest top-5 accuracy over income groups, column
0); ``acc_wg`` (GeoDE: the lowest accuracy over regions, column 0); ``jaccard_score_10-12`` (WinoGAViL).

The three numbers FastCLIP reports: the DataComp average (all tasks), the retrieval average (Flickr,
MSCOCO, WinoGAViL) and the ImageNet-and-variants average (ImageNet-1k and DataComp's "ImageNet dist. shifts"
group: -V2, -Sketch, -A, -O, -R, ObjectNet). An average has a ``value`` only when all its tasks were
evaluated, as DataComp's ``aggregate_scores.py`` gives one only then; otherwise ``value`` is null and
``mean_of_evaluated`` is the mean over the tasks evaluated, with how many of how many.

Precision (``precision``): "fp32" computes everything in float32; "datacomp" runs what DataComp runs
under ``torch.cuda.amp.autocast`` in fp16 on a GPU (the zero-shot classifiers' text embeddings, both
retrieval encoders, WinoGAViL's encoders and similarities) and the rest in float32. DataComp's published
numbers are the GPU's, so "datacomp" on a GPU is the setting that reproduces them; on a CPU that autocast
does nothing, and both settings are float32.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .collectives import Collectives, SingleRank, run_everywhere
from .hf_cache import prepared_split
from .metrics import classification_metrics, macro_f1, top5_hits, worst_group
from .sets import ClassificationSet, RetrievalSet, read_hf_retrieval_split, read_wds_folder
from .winogavil import evaluate_winogavil, find_winogavil, read_winogavil
from .zeroshot import Preprocess, Tokenize, build_zeroshot_classifier, classify, retrieve

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Task:
    key: str
    name: str
    main_metric: str = "acc1"
    folders: tuple[str, ...] | None = ()
    """Folder names to look for under the datasets root; empty: DataComp's and clip_benchmark's; None: the
    task has no webdataset folder (WinoGAViL)."""
    hf_repo: str | None = None
    """The Hugging Face dataset DataComp reads the task from, looked for first in ``<root>/hf_cache``."""

    def folder_names(self) -> tuple[str, ...]:
        if self.folders is None or self.folders:
            return self.folders or ()
        name = self.key.removeprefix("fairness/").replace("/", "-")
        return (f"wds_{name}_test", f"wds_{name}")


# DataComp's tasklist.yml, in its order (see the module docstring for the commit)
TASKS: tuple[Task, ...] = (
    Task("vtab/caltech101", "Caltech-101", "mean_per_class_recall"),
    Task("cifar10", "CIFAR-10"),
    Task("vtab/cifar100", "CIFAR-100"),
    Task("vtab/clevr_count_all", "CLEVR Counts"),
    Task("vtab/clevr_closest_object_distance", "CLEVR Distance"),
    Task("country211", "Country211"),
    Task("vtab/dtd", "Describable Textures"),
    Task("vtab/eurosat", "EuroSAT"),
    Task("fgvc_aircraft", "FGVC Aircraft", "mean_per_class_recall"),
    Task("food101", "Food-101"),
    Task("gtsrb", "GTSRB"),
    Task("imagenet1k", "ImageNet 1k"),
    Task("imagenet_sketch", "ImageNet Sketch"),
    Task("imagenetv2", "ImageNet v2"),
    Task("imagenet-a", "ImageNet-A"),
    Task("imagenet-o", "ImageNet-O"),
    Task("imagenet-r", "ImageNet-R"),
    Task("vtab/kitti_closest_vehicle_distance", "KITTI Vehicle Distance"),
    Task("mnist", "MNIST"),
    Task("objectnet", "ObjectNet"),
    Task("vtab/flowers", "Oxford Flowers-102", "mean_per_class_recall"),
    Task("vtab/pets", "Oxford-IIIT Pet", "mean_per_class_recall"),
    Task("voc2007", "Pascal VOC 2007"),
    Task("vtab/pcam", "PatchCamelyon"),
    Task("renderedsst2", "Rendered SST2"),
    Task("vtab/resisc45", "RESISC45"),
    Task("cars", "Stanford Cars"),
    Task("stl10", "STL-10"),
    Task("sun397", "SUN397"),
    Task("vtab/svhn", "SVHN"),
    Task(
        "retrieval/flickr_1k_test_image_text_retrieval",
        "Flickr",
        "mean_recall@1",
        folders=("wds_flickr30k", "wds_flickr30k_test"),
        hf_repo="nlphuji/flickr_1k_test_image_text_retrieval",
    ),
    Task(
        "retrieval/mscoco_2014_5k_test_image_text_retrieval",
        "MSCOCO",
        "mean_recall@1",
        folders=("wds_mscoco_captions", "wds_mscoco_captions_test"),
        hf_repo="nlphuji/mscoco_2014_5k_test_image_text_retrieval",
    ),
    Task("misc/winogavil", "WinoGAViL", "jaccard_score_10-12", folders=None, hf_repo="nlphuji/winogavil"),
    Task("wilds/iwildcam", "iWildCam", "F1-macro_all"),
    Task("wilds/camelyon17", "Camelyon17"),
    Task("wilds/fmow", "FMoW", "acc_worst_region"),
    Task("fairness/dollar_street", "Dollar Street", "acc_top5_wg"),
    Task("fairness/geode", "GeoDE", "acc_wg"),
)
RETRIEVAL = ("Flickr", "MSCOCO", "WinoGAViL")
#: ImageNet-1k and DataComp's "ImageNet dist. shifts" group (mlfoundations/datacomp aggregate_scores.py:8-15
#: at 4a8df19): FastCLIP's code computes no such average; its evaluation is DataComp's, whose grouping this is
IMAGENET_AND_VARIANTS = (
    "ImageNet 1k",
    "ImageNet v2",
    "ImageNet Sketch",
    "ImageNet-A",
    "ImageNet-O",
    "ImageNet-R",
    "ObjectNet",
)
AVERAGES = {
    "datacomp_average": tuple(task.name for task in TASKS),
    "retrieval_average": RETRIEVAL,
    "imagenet_and_variants_average": IMAGENET_AND_VARIANTS,
}
# main metrics computed from a classification's predictions and metadata column 0 (the group)
_GROUP_METRICS: dict[str, Callable[[Any], float]] = {
    "F1-macro_all": lambda p: macro_f1(p.labels, p.predicted),
    # WILDS' and GeoDE's accuracies take the arg-max class; Dollar Street's top 5 is torch.topk's
    "acc_worst_region": lambda p: worst_group(p.predicted == p.labels, _group_column(p)),
    "acc_top5_wg": lambda p: worst_group(top5_hits(p.labels, p.top_classes), _group_column(p)),
    "acc_wg": lambda p: worst_group(p.predicted == p.labels, _group_column(p)),
}


PRECISIONS = ("fp32", "datacomp")
WINOGAVIL = "misc/winogavil"


def find_task_folders(root: str | os.PathLike) -> tuple[dict[Task, Path], list[Task]]:
    """The tasks found under ``root``, each with where it is read from (a webdataset folder, or the Arrow
    file or CSV of its Hugging Face split in ``root/hf_cache``), and the tasks not found. A task DataComp
    reads from Hugging Face is looked for there first, as DataComp reads it."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such datasets root (a folder of clip_benchmark wds_* folders)")
    found, missing = {}, []
    for task in TASKS:
        folder = None
        if task.key == WINOGAVIL:
            folder = find_winogavil(root / "hf_cache")
        elif task.hf_repo:
            folder = next(iter(prepared_split(root / "hf_cache", task.hf_repo) or []), None)
        if folder is None:
            folder = next((root / name for name in task.folder_names() if (root / name).is_dir()), None)
        if folder is None:
            missing.append(task)
        else:
            found[task] = folder
    return found, missing


@torch.no_grad()
def evaluate_datacomp(
    model: nn.Module,
    *,
    tokenize: Tokenize,
    preprocess: Preprocess,
    datasets_root: str | os.PathLike,
    batch_size: int,
    device: torch.device | str,
    precision: str = "fp32",
    workers: int = 0,
    collectives: Collectives | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Every task found under ``datasets_root``: ``{"tasks": [per task: key, name, folder, main_metric,
    metrics], "missing": [keys], "averages": {name: {"value", "mean_of_evaluated", "tasks", "of"}}}``, the
    same on every rank. ``precision``: "fp32" or "datacomp" (the module docstring)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    collectives = collectives or SingleRank()
    found = _found_on_every_rank(datasets_root, collectives, device)
    missing = [task for task in TASKS if task not in found]
    if not found:
        raise FileNotFoundError(
            f"{datasets_root}: no DataComp task found (looked for e.g. "
            f"{' or '.join(TASKS[11].folder_names())} for ImageNet 1k)"
        )
    # a folder clip_benchmark cannot read stops the run here, before hours of other tasks
    run_everywhere(collectives, device, lambda: _check_layouts(found))
    fp16 = datacomp_autocast(precision, device)
    common = dict(device=device, workers=workers, collectives=collectives, progress=progress)
    rows = []
    for task, folder in found.items():
        log.info("DataComp task %s (%s)", task.name, folder)
        if task.key == WINOGAVIL:
            read = functools.partial(read_winogavil, Path(datasets_root) / "hf_cache")
            instances = run_everywhere(collectives, device, read)
            metrics = evaluate_winogavil(
                model, tokenize, instances, preprocess=preprocess, autocast_dtype=fp16, **common
            )
        else:
            read = functools.partial(_read_task, task, folder, Path(datasets_root) / "hf_cache")
            evalset = run_everywhere(collectives, device, read)
            loading = dict(preprocess=preprocess, batch_size=batch_size, **common)
            if task.main_metric == "mean_recall@1":
                metrics = _retrieval(model, tokenize, evalset, autocast_dtype=fp16, **loading)
            else:
                metrics = _classification(model, tokenize, evalset, task, text_autocast=fp16, **loading)
        rows.append(
            {
                "key": task.key,
                "name": task.name,
                "folder": str(folder),
                "main_metric": metrics[task.main_metric],
                "main_metric_name": task.main_metric,
                "metrics": metrics,
            }
        )
    return {
        "suite": "datacomp",
        "precision": precision,
        "tasks": rows,
        "missing": [task.key for task in missing],
        "averages": averages(rows),
    }


def datacomp_autocast(precision: str, device: torch.device | str) -> torch.dtype | None:
    """The autocast of the stages DataComp runs under ``torch.cuda.amp.autocast``: fp16 on a GPU with
    ``precision="datacomp"``; None (float32) otherwise, as that autocast does nothing off a GPU."""
    return torch.float16 if precision == "datacomp" and torch.device(device).type == "cuda" else None


def _retrieval(model, tokenize, evalset: RetrievalSet, **loading) -> dict[str, Any]:
    """DataComp's retrieval metrics (``retr_eval.py``): clip_benchmark's recalls and their R@1 mean."""
    recall = retrieve(model, tokenize, evalset, **loading)
    metrics = {
        **{f"image_retrieval_recall@{k}": recall[f"text_to_image_R@{k}"] for k in (1, 5, 10)},
        **{f"text_retrieval_recall@{k}": recall[f"image_to_text_R@{k}"] for k in (1, 5, 10)},
        "num_samples": recall["num_samples"],
    }
    if recall["num_skipped"]:
        metrics["num_skipped"] = recall["num_skipped"]
    metrics["mean_recall@1"] = 0.5 * (
        metrics["image_retrieval_recall@1"] + metrics["text_retrieval_recall@1"]
    )
    return metrics


def _classification(
    model, tokenize, evalset: ClassificationSet, task: Task, *, text_autocast, **loading
) -> dict[str, Any]:
    """DataComp's classification metrics (``wds_eval.py``, ``wilds_eval.py``, ``fairness_eval.py``): the
    classifier's prompts encoded under ``text_autocast`` (clip_benchmark's default amp), the images
    without (DataComp passes ``amp=False``)."""
    shared = {key: loading[key] for key in ("device", "collectives", "progress")}
    classifier = build_zeroshot_classifier(
        model, tokenize, evalset.classnames, evalset.templates, autocast_dtype=text_autocast, **shared
    )
    predictions = classify(model, classifier, evalset, **loading)
    scores = classification_metrics(
        predictions.labels, predictions.top_classes, predictions.predicted, predictions.num_classes
    )
    metrics = {"acc1": scores.pop("top1"), **({"acc5": scores.pop("top5")} if "top5" in scores else {})}
    metrics.update(scores)
    if task.main_metric in _GROUP_METRICS:
        metrics[task.main_metric] = _GROUP_METRICS[task.main_metric](predictions)
    if predictions.num_skipped:
        metrics["num_skipped"] = predictions.num_skipped
    return metrics


def averages(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The three averages: ``value`` only where every task of one was evaluated (a mean over fewer tasks is
    another number, which DataComp's aggregate_scores.py refuses to give), ``mean_of_evaluated`` over the
    tasks evaluated (None without any), and how many tasks of how many. Each is ``np.mean`` of the main
    metrics in task-list order, as aggregate_scores.py takes its average over the results file; a task
    whose main metric is None (WinoGAViL without a 10-12 instance) counts as not evaluated."""
    result = {}
    for name, members in AVERAGES.items():
        present = [row["main_metric"] for row in rows if row["name"] in members]
        present = [score for score in present if score is not None]
        mean = float(np.mean(present)) if present else None
        result[name] = {
            "value": mean if len(present) == len(members) else None,
            "mean_of_evaluated": mean,
            "tasks": len(present),
            "of": len(members),
        }
    return result


def format_datacomp(results: dict[str, Any]) -> str:
    """Per-task rows (main metric), then the three averages, each with how many of its tasks it covers."""
    width = max([len(row["name"]) for row in results["tasks"]] + [30])
    lines = [f"{'task':<{width}}  {'main metric':<22}  value"]
    for row in results["tasks"]:
        skipped = row["metrics"].get("num_skipped", 0)
        note = f"  ({skipped} unreadable samples skipped)" if skipped else ""
        score = "n/a" if row["main_metric"] is None else f"{row['main_metric']:.4f}"
        lines.append(f"{row['name']:<{width}}  {row['main_metric_name']:<22}  {score}{note}")
    lines.append("")
    for name, average in results["averages"].items():
        mean = average["mean_of_evaluated"]
        value = "n/a" if mean is None else f"{mean:.4f}"
        partial = (
            ""
            if average["value"] is not None or mean is None
            else "  (partial: the mean of the tasks evaluated)"
        )
        lines.append(f"{name:<{width}}  {average['tasks']:>2} of {average['of']:<16}  {value}{partial}")
    if results["missing"]:
        lines.append(f"missing ({len(results['missing'])}): {', '.join(results['missing'])}")
    return "\n".join(lines)


def _group_column(predictions: Any) -> torch.Tensor:
    if predictions.metadata is None or predictions.metadata.ndim != 2:
        raise ValueError(
            "this task's main metric groups samples by their .npy metadata; the shards carry none"
        )
    return predictions.metadata[:, 0]


def _found_on_every_rank(root: str | os.PathLike, collectives: Collectives, device) -> dict[Task, Path]:
    """The task folders under ``root``, checked to be the same on every rank (each rank reads its own
    share of every task: a task only some ranks see would leave the others waiting, and a task read
    from another source on another rank would mix two sample lists)."""
    found = run_everywhere(collectives, device, lambda: find_task_folders(root)[0])
    mine = torch.tensor([[_source_kind(found.get(task)) for task in TASKS]], dtype=torch.int64, device=device)
    everyone = collectives.gather(mine)
    if not bool((everyone == everyone[0]).all()):
        raise ValueError(
            f"{root}: the ranks see different task folders (or read a task from different sources); give "
            "every rank the same datasets root"
        )
    return found


def _source_kind(source: Path | None) -> int:
    """0: not found; 1: a webdataset folder; 2: a prepared Hugging Face split; 3: a downloaded CSV."""
    if source is None:
        return 0
    return 1 if source.is_dir() else 2 if source.suffix == ".arrow" else 3


def _check_layouts(found: dict[Task, Path]) -> None:
    """Every webdataset folder found has clip_benchmark's ``test/nshards.txt``: clip_benchmark (and so
    DataComp) reads the shard list from it, and refuses a folder without."""
    for task, folder in found.items():
        if folder.is_dir() and not (folder / "test" / "nshards.txt").is_file():
            raise FileNotFoundError(
                f"{folder / 'test' / 'nshards.txt'}: missing; clip_benchmark, which DataComp runs, reads a "
                f"folder's shards from it ({task.name}). DataComp's download_evalsets.py writes it"
            )


def _read_task(task: Task, folder: Path, hf_cache: Path) -> ClassificationSet | RetrievalSet:
    if folder.suffix == ".arrow":  # the task's Hugging Face split (find_task_folders)
        files = prepared_split(hf_cache, task.hf_repo)
        return read_hf_retrieval_split(files, hf_cache, name=task.key)
    evalset = read_wds_folder(folder, name=task.key)
    retrieval = task.main_metric == "mean_recall@1"
    if retrieval != isinstance(evalset, RetrievalSet):
        kind = "a retrieval task (dataset_type.txt: retrieval)" if retrieval else "a classification task"
        raise ValueError(f"{folder}: {task.name} is {kind}; the folder holds the other kind")
    return evalset
