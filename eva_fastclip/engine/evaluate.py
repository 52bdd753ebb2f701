"""Run the configured evaluations on a model, on every rank with its share, and present the results.

``evaluate_model`` reads the sets named in ``eval.*`` (the zero-shot folder, ImageNet's validation folder,
the retrieval shards) and returns one flat dict of metrics, the same on every rank, with the chance level
beside each. Every rank must call it (``collectives`` carries the process group); it cannot deadlock: a
rank that fails raises on every rank (evaluation/collectives.py).

**Precision** (``eval.precision``, :class:`EvalPrecision`): a checkpoint's figures are the same in the run
that saved it and in ``eva-fastclip eval``, because both evaluate the weights as the run held them in the
precision asked for. ``auto`` is the precision the model was trained in: a run evaluates its own module,
``eva-fastclip eval`` casts the checkpoint's fp32 weights to the dtype DeepSpeed kept the module in
(:func:`hold_as_trained`). Any other precision evaluates the fp32 weights under autocast, in a run with a
bf16 or fp16 module its fp32 masters (:func:`fp32_weights`). Both print which precision they used.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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
    caption_key: str = "txt",
) -> dict[str, float]:
    """Zero-shot top-1/5 (``zeroshot_*`` for eval.zeroshot_dir, ``imagenet_*`` for eval.imagenet_val) and
    retrieval R@1/5/10 (``retrieval_*``; each image's caption under ``caption_key``: data.caption_keys'
    first), each with its chance level."""
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
        read = functools.partial(read_pair_shards, cfg.retrieval_shards, caption_key=caption_key)
        evalset = run_everywhere(collectives, device, read)
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


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, slots=True)
class EvalPrecision:
    """What an evaluation computes in, and why: printed beside its figures."""

    name: str
    """bf16, fp16 or fp32."""
    reason: str

    @property
    def autocast(self) -> torch.dtype | None:
        return None if self.name == "fp32" else DTYPES[self.name]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def line(self) -> str:
        return f"evaluated in {self.name} ({self.reason})"

    @classmethod
    def choose(cls, setting: str, trained: str | None, what: str) -> EvalPrecision:
        """``eval.precision`` for a model ``what`` describes, trained in ``trained`` (None: unknown)."""
        if setting != "auto":
            return cls(setting, f"eval.precision={setting}")
        if trained is None:
            return cls("fp32", f"eval.precision=auto: {what} records no training precision")
        return cls(trained, f"eval.precision=auto: {what} trained in {trained}")


def weights_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a module holds its floating-point weights in."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


@contextlib.contextmanager
def fp32_weights(
    module: nn.Module, precision: EvalPrecision, full_parameter: Callable[[nn.Parameter], torch.Tensor]
) -> Iterator[nn.Module]:
    """``module`` as a run evaluates it in ``precision``: as it is, unless it holds bf16 or fp16 weights
    (DeepSpeed's bf16 / fp16 engines) and another precision is asked for; then, for the evaluation only,
    its fp32 weights (``full_parameter``: ZeRO's masters, a collective every rank calls) and fp32
    BatchNorm statistics in place of the low-precision ones, which come back afterwards."""
    held = weights_dtype(module)
    if held == torch.float32 or held == precision.dtype:
        yield module
        return
    params = [p for p in module.parameters() if p.is_floating_point()]
    stats = [b for b in _running_statistics(module) if b.is_floating_point()]
    saved = [p.data for p in params] + [b.data for b in stats]
    with torch.no_grad():
        for p in params:
            p.data = full_parameter(p).to(p.device, torch.float32).view_as(p)
        for b in stats:
            b.data = b.data.float()
    try:
        yield module
    finally:
        for tensor, data in zip(params + stats, saved, strict=True):
            tensor.data = data


def hold_as_trained(model: nn.Module, precision: EvalPrecision, saved_dtype: torch.dtype) -> None:
    """``eva-fastclip eval``: an fp32 model loaded from a checkpoint, held as its run held it to evaluate
    in ``precision``: where DeepSpeed kept the module in that very dtype (bf16 / fp16 training without
    autocast, ``saved_dtype``), its parameters cast to it as DeepSpeed casts them (buffers stay fp32)
    and BatchNorm's statistics with them (engine/setup.py); otherwise left in fp32."""
    if precision.name == "fp32" or saved_dtype != precision.dtype:
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(saved_dtype)
        for b in _running_statistics(model):
            if b.is_floating_point():
                b.data = b.data.to(saved_dtype)


def _running_statistics(module: nn.Module) -> list[torch.Tensor]:
    return [
        buffer
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase)
        for buffer in (m.running_mean, m.running_var)
        if buffer is not None
    ]


def _classification_set(read, folder: str) -> ClassificationSet:
    evalset = read(folder)
    if not isinstance(evalset, ClassificationSet):
        raise ValueError(
            f"{folder}: a retrieval folder (dataset_type.txt) where a classification set belongs"
        )
    return evalset


def format_results(results: dict[str, float], precision: EvalPrecision | None = None) -> str:
    """A short table: metric, value, chance level; under it, the precision evaluated in."""
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
    if precision is not None:
        lines.append(precision.line())
    return "\n".join(lines)
