"""Zero-shot classification and image-text retrieval on every rank, each with its share.

Works on a plain (unwrapped) model exposing ``encode_image(images)`` and ``encode_text(tokens)``; the
ranks meet only through ``collectives`` (see collectives.py): the classifier's classes are split between
ranks (class c on rank c mod W), the images in whole batches (samples.py), and what each rank computed is
gathered once at the end, so every rank returns the same result, equal to one rank's.

Embeddings are computed as clip_benchmark computes them (normalised in float32; a class's embedding is the
re-normalised mean over its prompts, all prompts of one class in one batch), so in fp32 the scores agree
with clip_benchmark's evaluator exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from .collectives import Collectives, SingleRank, gather_rows, run_everywhere
from .metrics import retrieval_recall, top_classes
from .samples import SampleDataset, share_loader
from .sets import ClassificationSet, RetrievalSet

Device = torch.device | str
Preprocess = Callable[..., Tensor]
Tokenize = Callable[[list[str]], Tensor]


@dataclass(frozen=True, slots=True)
class Predictions:
    """Per evaluated sample, in sample order: its label, its top classes (``metrics.top_classes``: [N, 5],
    [N, 1] under 5 classes), its arg-max class and its metadata row (WILDS and fairness sets; else None)."""

    ordinals: Tensor
    labels: Tensor
    top_classes: Tensor
    predicted: Tensor
    metadata: Tensor | None
    num_classes: int
    num_skipped: int


@torch.no_grad()
def build_zeroshot_classifier(
    model: nn.Module,
    tokenize: Tokenize,
    classnames: Sequence[str],
    templates: Sequence[str],
    *,
    device: Device,
    autocast_dtype: torch.dtype | None = None,
    collectives: Collectives | None = None,
    progress: bool = False,
) -> Tensor:
    """The zero-shot classifier [d, C] in float32 on ``device``, the same on every rank.

    Each template marks the class name's place with "{c}" (clip_benchmark's convention) or "{}". Column c
    is the mean of the L2-normalised text embeddings of class c over all templates, re-normalised.
    """
    collectives = collectives or SingleRank()
    if not classnames or not templates:
        raise ValueError("need at least one class name and one template")
    own = range(collectives.rank, len(classnames), collectives.world_size)

    def encode_own_classes() -> Tensor:
        columns = []
        with _eval_mode(model), _autocast(device, autocast_dtype):
            for c in tqdm(own, desc="zero-shot classifier", disable=not progress):
                texts = [fill_template(template, classnames[c]) for template in templates]
                embeddings = F.normalize(_encode_texts(model, tokenize(texts), device), dim=-1)
                mean = embeddings.mean(dim=0)
                columns.append(mean / mean.norm())
        return torch.stack(columns) if columns else torch.zeros(0)

    rows = run_everywhere(collectives, device, encode_own_classes)
    rows = gather_rows(collectives, rows, device)
    order = gather_rows(collectives, torch.tensor(list(own), dtype=torch.int64), device)
    classifier = torch.empty_like(rows)
    classifier[order] = rows
    return classifier.T.contiguous()


@torch.no_grad()
def zeroshot_classify(
    model: nn.Module,
    tokenize: Tokenize,
    evalset: ClassificationSet,
    *,
    device: Device,
    autocast_dtype: torch.dtype | None = None,
    collectives: Collectives | None = None,
    progress: bool = False,
    **loading: Any,
) -> Predictions:
    """:func:`classify` ``evalset`` with the classifier built from its own class names and templates;
    ``loading`` is classify's preprocess, batch_size and workers."""
    shared = dict(device=device, autocast_dtype=autocast_dtype, collectives=collectives, progress=progress)
    classifier = build_zeroshot_classifier(model, tokenize, evalset.classnames, evalset.templates, **shared)
    return classify(model, classifier, evalset, **shared, **loading)


def classify(
    model: nn.Module,
    classifier: Tensor,
    evalset: ClassificationSet,
    *,
    preprocess: Preprocess,
    batch_size: int,
    device: Device,
    autocast_dtype: torch.dtype | None = None,
    workers: int = 0,
    collectives: Collectives | None = None,
    progress: bool = False,
) -> Predictions:
    """Score this rank's share of ``evalset`` against ``classifier`` [d, C]; every rank gets every rank's
    predictions. A label outside the class list stops the evaluation on every rank."""
    collectives = collectives or SingleRank()
    classifier = classifier.to(device=device, dtype=torch.float32)
    num_classes = classifier.shape[1]

    def score_own_share() -> dict[str, Tensor]:
        parts: dict[str, list[Tensor]] = {
            "ordinals": [],
            "labels": [],
            "top": [],
            "predicted": [],
            "meta": [],
        }
        batches = _own_batches(evalset, preprocess, batch_size, collectives, workers, progress)
        with _eval_mode(model):
            for ordinals, images, targets in batches:
                labels = torch.tensor([label for label, _ in targets], dtype=torch.int64)
                bad = labels[(labels < 0) | (labels >= num_classes)]
                if len(bad):
                    raise ValueError(
                        f"{evalset.name}: class label {int(bad[0])} outside [0, {num_classes}): the class "
                        "list (classnames.txt) does not match the shards"
                    )
                with _autocast(device, autocast_dtype):
                    features = F.normalize(_encode_images(model, images, device), dim=-1)
                logits = (100.0 * features @ classifier).cpu()  # clip_benchmark's logits, to the bit
                parts["ordinals"].append(ordinals)
                parts["labels"].append(labels)
                parts["top"].append(top_classes(logits))
                parts["predicted"].append(logits.argmax(dim=1))
                if targets[0][1] is not None:
                    parts["meta"].append(torch.as_tensor(np.stack([meta for _, meta in targets])).double())
        return {key: torch.cat(values) if values else torch.zeros(0) for key, values in parts.items()}

    own = run_everywhere(collectives, device, score_own_share)
    gathered = {
        key: gather_rows(collectives, value.to(torch.float64 if key == "meta" else torch.int64), device).cpu()
        for key, value in own.items()
    }
    order = gathered["ordinals"].argsort()
    if gathered["meta"].numel() and len(gathered["meta"]) != len(order):
        raise ValueError(f"{evalset.name}: some samples carry a .npy metadata row and others do not")
    metadata = gathered["meta"][order] if gathered["meta"].numel() else None
    return Predictions(
        ordinals=gathered["ordinals"][order],
        labels=gathered["labels"][order],
        top_classes=gathered["top"][order],
        predicted=gathered["predicted"][order],
        metadata=metadata,
        num_classes=num_classes,
        num_skipped=len(evalset.samples) - len(order),
    )


@torch.no_grad()
def retrieve(
    model: nn.Module,
    tokenize: Tokenize,
    evalset: RetrievalSet,
    *,
    preprocess: Preprocess,
    batch_size: int,
    device: Device,
    autocast_dtype: torch.dtype | None = None,
    workers: int = 0,
    collectives: Collectives | None = None,
    progress: bool = False,
    ks: Sequence[int] = (1, 5, 10),
) -> dict[str, float | int]:
    """Image->text and text->image Recall@k over ``evalset`` (an image hits if any of its captions is in
    its top k), each rank encoding its share; keys of ``metrics.retrieval_recall`` plus "num_samples"
    (images), "num_texts" and "num_skipped" (images that could not be read)."""
    collectives = collectives or SingleRank()

    def encode_own_share() -> dict[str, Tensor]:
        parts: dict[str, list[Tensor]] = {"images": [], "ordinals": [], "texts": [], "owners": []}
        batches = _own_batches(evalset, preprocess, batch_size, collectives, workers, progress)
        with _eval_mode(model):
            for ordinals, images, captions in batches:
                texts = [text for per_image in captions for text in per_image]
                owners = [int(o) for o, per_image in zip(ordinals, captions) for _ in per_image]
                with _autocast(device, autocast_dtype):
                    parts["images"].append(F.normalize(_encode_images(model, images, device), dim=-1).cpu())
                    if texts:
                        encoded = _encode_texts(model, tokenize(texts), device)
                        parts["texts"].append(F.normalize(encoded, dim=-1).cpu())
                parts["ordinals"].append(ordinals)
                parts["owners"].append(torch.tensor(owners, dtype=torch.int64))
        return {key: torch.cat(values) if values else torch.zeros(0) for key, values in parts.items()}

    own = run_everywhere(collectives, device, encode_own_share)
    gathered = {
        key: gather_rows(
            collectives, value.to(torch.int64 if key in ("ordinals", "owners") else torch.float32), device
        )
        for key, value in own.items()
    }
    if not len(gathered["ordinals"]):
        raise ValueError(f"{evalset.name}: no sample could be read")
    order = gathered["ordinals"].argsort()
    images, ordinals = gathered["images"][order], gathered["ordinals"][order]
    text_order = torch.sort(gathered["owners"], stable=True).indices
    texts, owners = gathered["texts"][text_order], gathered["owners"][text_order]
    text_to_image = torch.searchsorted(ordinals, owners)
    metrics = retrieval_recall(images, texts, text_to_image, ks, batch_size=batch_size, device=device)
    skipped = len(evalset.samples) - len(images)
    return {**metrics, "num_samples": len(images), "num_texts": len(texts), "num_skipped": skipped}


def fill_template(template: str, classname: str) -> str:
    """Put the class name into a prompt template written with "{c}" or "{}"."""
    if "{c}" in template:
        return template.replace("{c}", classname)
    if "{}" in template:
        return template.replace("{}", classname)
    raise ValueError(f"prompt template {template!r} has no '{{c}}' placeholder for the class name")


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    # Restore every submodule's own flag, not just the root's: a frozen tower may be kept in eval mode.
    previous = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, was_training in previous:
            module.training = was_training


def _autocast(device: Device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def _input_dtype(model: nn.Module) -> torch.dtype:
    # A model whose weights were cast (e.g. to bf16 by the training engine) needs images of the same dtype.
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def _encode_images(model: nn.Module, images: Tensor, device: Device) -> Tensor:
    images = images.to(device=device, dtype=_input_dtype(model), non_blocking=True)
    return model.encode_image(images).float()  # normalised by the caller in float32, as clip_benchmark


def _encode_texts(model: nn.Module, tokens: Tensor, device: Device) -> Tensor:
    return model.encode_text(tokens.to(device=device, non_blocking=True)).float()


def _own_batches(evalset, preprocess, batch_size: int, collectives, workers: int, progress: bool):
    """This rank's share of ``evalset``: (ordinals, images, targets) batches, the empty ones left out."""
    dataset = SampleDataset(evalset.samples, preprocess, evalset.target)
    loader = share_loader(
        dataset,
        batch_size=batch_size,
        rank=collectives.rank,
        world_size=collectives.world_size,
        workers=workers,
    )
    for ordinals, images, targets in tqdm(loader, desc=evalset.name, disable=not progress):
        if images is not None:
            yield ordinals, images, targets
