"""Zero-shot classification and retrieval evaluation for open_clip-style models.

Works on a plain (unwrapped) model exposing `encode_image(images, normalize=True)` and
`encode_text(tokens, normalize=True)`; nothing here knows about DeepSpeed or torch.distributed.
"""

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from .metrics import retrieval_recall, topk_hits

Device = torch.device | str


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
    # Re-normalise in float32: under autocast the model's own normalisation ran in low precision.
    return F.normalize(model.encode_image(images, normalize=True).float(), dim=-1)


def _encode_texts(model: nn.Module, tokens: Tensor, device: Device) -> Tensor:
    tokens = tokens.to(device=device, non_blocking=True)
    return F.normalize(model.encode_text(tokens, normalize=True).float(), dim=-1)


@torch.no_grad()
def build_zeroshot_classifier(
    model: nn.Module,
    tokenize: Callable[[list[str]], Tensor],
    classnames: Sequence[str],
    templates: Sequence[str],
    *,
    device: Device,
    batch_size: int = 256,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> Tensor:
    """Return the zero-shot classifier [d, C] in float32 on `device`.

    Each template marks the class name's place with "{c}" (clip_benchmark's convention) or "{}".
    Column c is the mean of the L2-normalised text embeddings of class c over all templates,
    re-normalised.
    """
    if not classnames or not templates:
        raise ValueError("need at least one class name and one template")
    texts = [fill_template(template, name) for name in classnames for template in templates]
    chunks = []
    with _eval_mode(model), _autocast(device, autocast_dtype):
        for start in tqdm(
            range(0, len(texts), batch_size), desc="zero-shot classifier", disable=not progress
        ):
            chunks.append(_encode_texts(model, tokenize(texts[start : start + batch_size]), device))
    embeddings = torch.cat(chunks).view(len(classnames), len(templates), -1)
    return F.normalize(embeddings.mean(dim=1), dim=-1).T.contiguous()


@torch.no_grad()
def evaluate_classification(
    model: nn.Module,
    classifier: Tensor,
    loader: Iterable[tuple[Tensor, Tensor]],
    *,
    device: Device,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Zero-shot top-1/top-5 accuracy over (images, integer labels) batches.

    Returns {"top1", "top5", "num_samples"}.
    """
    classifier = classifier.to(device=device, dtype=torch.float32)
    # Count hits batch by batch rather than keeping the full [N, C] logits matrix.
    hits = {"top1": 0, "top5": 0}
    num_samples = 0
    with _eval_mode(model):
        for images, labels in tqdm(loader, desc="zero-shot classification", disable=not progress):
            with _autocast(device, autocast_dtype):
                features = _encode_images(model, images, device)
            logits = features @ classifier
            for name, batch_hits in topk_hits(logits, labels.to(device), ks=(1, 5)).items():
                hits[name] += int(batch_hits.sum())
            num_samples += len(labels)
    if num_samples == 0:
        raise ValueError("classification loader yielded no samples")
    return {name: count / num_samples for name, count in hits.items()} | {"num_samples": num_samples}


@torch.no_grad()
def evaluate_retrieval(
    model: nn.Module,
    loader: Iterable[tuple[Tensor, Tensor]],
    *,
    device: Device,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Image<->text Recall@1/5/10 over (images, tokens) batches holding one caption per image, in order.

    Returns the keys of `retrieval_recall` plus "num_samples".
    """
    image_chunks, text_chunks = [], []
    with _eval_mode(model):
        for images, tokens in tqdm(loader, desc="retrieval", disable=not progress):
            if len(images) != len(tokens):
                raise ValueError(f"expected one caption per image, got {len(images)} and {len(tokens)}")
            with _autocast(device, autocast_dtype):
                image_chunks.append(_encode_images(model, images, device).cpu())
                text_chunks.append(_encode_texts(model, tokens, device).cpu())
    if not image_chunks:
        raise ValueError("retrieval loader yielded no samples")
    image_features, text_features = torch.cat(image_chunks), torch.cat(text_chunks)
    num_samples = len(image_features)
    metrics = retrieval_recall(image_features, text_features, torch.arange(num_samples))
    return {**metrics, "num_samples": num_samples}


def fill_template(template: str, classname: str) -> str:
    """Put the class name into a prompt template written with "{c}" or "{}"."""
    if "{c}" in template:
        return template.replace("{c}", classname)
    if "{}" in template:
        return template.replace("{}", classname)
    raise ValueError(f"prompt template {template!r} has no '{{c}}' placeholder for the class name")
