"""Run the configured zero-shot evaluations on a model and present the results beside chance level."""

from __future__ import annotations

import torch
from torch import nn

from eva_fastclip.config import EvalConfig
from eva_fastclip.data import build_classification_loader, build_retrieval_loader
from eva_fastclip.evaluation import build_zeroshot_classifier, evaluate_classification, evaluate_retrieval
from eva_fastclip.models import ModelBundle


def evaluate_model(
    model: nn.Module, bundle: ModelBundle, cfg: EvalConfig, *, device: torch.device, dtype: torch.dtype
) -> dict[str, float]:
    """Classification top-1/5 and retrieval R@1/5/10, with the chance level of each beside it."""
    autocast = dtype if dtype != torch.float32 else None
    results: dict[str, float] = {}
    if cfg.zeroshot_dir:
        loader, classnames, templates = build_classification_loader(
            cfg.zeroshot_dir, preprocess=bundle.preprocess_eval, batch_size=cfg.batch_size
        )
        classifier = build_zeroshot_classifier(
            model, bundle.tokenizer, classnames, templates, device=device, autocast_dtype=autocast
        )
        scores = evaluate_classification(model, classifier, loader, device=device, autocast_dtype=autocast)
        num_classes = len(classnames)
        results.update({f"zeroshot_{k}": v for k, v in scores.items()})
        results["zeroshot_top1_chance"] = 1.0 / num_classes
        results["zeroshot_top5_chance"] = min(5, num_classes) / num_classes
    if cfg.retrieval_shards:
        loader = build_retrieval_loader(
            cfg.retrieval_shards,
            preprocess=bundle.preprocess_eval,
            tokenize=bundle.tokenizer,
            batch_size=cfg.batch_size,
        )
        scores = evaluate_retrieval(model, loader, device=device, autocast_dtype=autocast)
        results.update({f"retrieval_{k}": v for k, v in scores.items()})
        n = scores["num_samples"]
        for k in (1, 5, 10):  # one caption per image: a random ranking hits with probability k/n
            results[f"retrieval_R@{k}_chance"] = min(k, n) / n
    return results


def format_results(results: dict[str, float]) -> str:
    """A short table: metric, value, chance level."""
    rows = [("metric", "value", "chance")]
    if "zeroshot_top1" in results:
        n = int(results["zeroshot_num_samples"])
        for k in ("top1", "top5"):
            rows.append(
                (f"zero-shot {k} ({n} images)", results[f"zeroshot_{k}"], results[f"zeroshot_{k}_chance"])
            )
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
