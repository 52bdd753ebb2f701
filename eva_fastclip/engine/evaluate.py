"""Run the configured evaluations on a model, on every rank with its share, and present the results.

``evaluate_model`` reads the sets named in ``eval.*`` (the zero-shot folder, ImageNet's validation folder,
the retrieval shards) and returns one flat dict of metrics, the same on every rank, with the chance level
beside each. Every rank must call it (``collectives`` carries the process group); it cannot deadlock: a
rank that fails raises on every rank (evaluation/collectives.py).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from eva_fastclip.config import EvalConfig
from eva_fastclip.evaluation import (
    ClassificationSet,
    Collectives,
    SingleRank,
    classification_metrics,
    read_imagenet_folder,
    read_pair_shards,
    read_wds_folder,
    retrieve,
    run_everywhere,
    zeroshot_classify,
)
from eva_fastclip.models import ModelBundle


def evaluate_model(
    model: nn.Module,
    bundle: ModelBundle,
    cfg: EvalConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    collectives: Collectives | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Zero-shot top-1/5 (``zeroshot_*`` for eval.zeroshot_dir, ``imagenet_*`` for eval.imagenet_val) and
    retrieval R@1/5/10 (``retrieval_*``), each with its chance level."""
    autocast = dtype if dtype != torch.float32 else None
    collectives = collectives or SingleRank()
    common = dict(
        preprocess=bundle.preprocess_eval,
        batch_size=cfg.batch_size,
        device=device,
        autocast_dtype=autocast,
        workers=cfg.workers,
        collectives=collectives,
        progress=progress,
    )
    results: dict[str, float] = {}
    classification = [
        ("zeroshot", cfg.zeroshot_dir, read_wds_folder),
        ("imagenet", cfg.imagenet_val, read_imagenet_folder),
    ]
    for prefix, folder, read in classification:
        if not folder:
            continue
        # read on every rank, and a failure to read raises on every rank (no rank left waiting)
        evalset = run_everywhere(collectives, device, functools.partial(_classification_set, read, folder))
        predictions = zeroshot_classify(model, bundle.tokenizer, evalset, **common)
        scores = classification_metrics(
            predictions.labels, predictions.top_classes, predictions.predicted, predictions.num_classes
        )
        num_classes = predictions.num_classes
        results[f"{prefix}_top1"] = scores["top1"]
        results[f"{prefix}_top5"] = scores.get("top5", 1.0)  # under 5 classes every sample is a top-5 hit
        results[f"{prefix}_num_samples"] = scores["num_samples"]
        results[f"{prefix}_top1_chance"] = 1.0 / num_classes
        results[f"{prefix}_top5_chance"] = min(5, num_classes) / num_classes
        if prefix == "imagenet":
            results["imagenet_num_classes"] = num_classes
        if predictions.num_skipped:
            results[f"{prefix}_num_skipped"] = predictions.num_skipped
    if cfg.retrieval_shards:
        evalset = run_everywhere(collectives, device, lambda: read_pair_shards(cfg.retrieval_shards))
        scores = retrieve(model, bundle.tokenizer, evalset, **common)
        scores.pop("num_texts")  # one caption per image
        skipped = scores.pop("num_skipped")
        results.update({f"retrieval_{k}": v for k, v in scores.items()})
        if skipped:
            results["retrieval_num_skipped"] = skipped
        n = scores["num_samples"]
        for k in (1, 5, 10):  # one caption per image: a random ranking hits with probability k/n
            results[f"retrieval_R@{k}_chance"] = min(k, n) / n
    return results


def _classification_set(read, folder: str) -> ClassificationSet:
    evalset = read(folder)
    if not isinstance(evalset, ClassificationSet):
        raise ValueError(
            f"{folder}: a retrieval folder (dataset_type.txt) where a classification set belongs"
        )
    return evalset


def format_results(results: dict[str, float]) -> str:
    """A short table: metric, value, chance level."""
    rows = [("metric", "value", "chance")]
    for prefix, what in (("zeroshot", "zero-shot"), ("imagenet", "ImageNet zero-shot")):
        if f"{prefix}_top1" in results:
            n = int(results[f"{prefix}_num_samples"])
            classes = f", {int(results['imagenet_num_classes'])} classes" if prefix == "imagenet" else ""
            for k in ("top1", "top5"):
                chance = results[f"{prefix}_{k}_chance"]
                rows.append((f"{what} {k} ({n} images{classes})", results[f"{prefix}_{k}"], chance))
    if "retrieval_num_samples" in results:
        n = int(results["retrieval_num_samples"])
        for direction in ("image_to_text", "text_to_image"):
            for k in (1, 5):
                key = f"retrieval_{direction}_R@{k}"
                rows.append(
                    (f"{direction} R@{k} ({n} pairs)", results[key], results[f"retrieval_R@{k}_chance"])
                )
    width = max(len(r[0]) for r in rows)
    lines = [f"{rows[0][0]:<{width}}  {rows[0][1]:>7}  {rows[0][2]:>7}"]
    lines += [f"{name:<{width}}  {value:7.3f}  {chance:7.3f}" for name, value, chance in rows[1:]]
    return "\n".join(lines)
