"""Pure tensor metrics for zero-shot classification and image-text retrieval.

Ties are broken as clip_benchmark breaks them, the evaluator DataComp runs (1.4.0, which it pins, and 1.6.x
compute these alike): a hit at k is the label (or a matching item) among ``torch.topk`` of k taken on the
same scores, in the same orientation, on the same device. ``torch.topk`` picks among equal scores by no
documented rule, so only the same call on the same numbers gives the same hits; any other rule (counting
every tied item ahead, say) scores a model with tied scores differently from the published numbers.

- Classification (``classification_metrics``): top-1 and top-5 from one ``topk(5)`` of the logits on the
  CPU (``topk(1)`` under 5 classes), as ``clip_benchmark.metrics.zeroshot_classification.accuracy``; the
  mean per-class recall, F1 and WILDS' worst groups from the arg-max class, as DataComp's evaluators.
- Retrieval (``retrieval_recall``): the scores are ``texts @ images.T`` on the CPU; each k is its own
  ``topk(k)`` over batches of rows on the evaluation device, text->image over the rows of that matrix and
  image->text over the rows of its transpose, and each recall the hits' float32 mean, as
  ``clip_benchmark.metrics.zeroshot_retrieval``.

The classification metrics DataComp scores tasks by (``classification_metrics``, ``worst_group``) are
computed as DataComp's evaluation computes them: top-k accuracies as exact fractions, sklearn's balanced
accuracy and macro F1 over the labels present, WILDS' worst group (the lowest float32 accuracy over the
groups that have samples).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

#: clip_benchmark's zero-shot accuracy takes top-1 and top-5 from one topk(5); under 5 classes, topk(1)
TOP_K = 5


def top_classes(logits: Tensor) -> Tensor:
    """Per row of ``logits`` [N, C]: the classes ``topk`` ranks first, [N, 5] (under 5 classes [N, 1]),
    taken on the CPU in float32 as clip_benchmark's accuracy takes them."""
    if logits.ndim != 2:
        raise ValueError(f"expected logits [N, C], got {list(logits.shape)}")
    k = TOP_K if logits.shape[1] >= TOP_K else 1
    return logits.float().cpu().topk(k, dim=1, largest=True, sorted=True).indices


def topk_accuracy(logits: Tensor, labels: Tensor, ks: Sequence[int] = (1, 5)) -> dict[str, float]:
    """Top-k accuracy of ``logits`` [N, C] against integer ``labels`` [N]; keys "top{k}". One ``topk`` of
    the largest k, as clip_benchmark; a k of C or more is a hit for every sample (clip_benchmark fails)."""
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [N, C], labels [N]; got {list(logits.shape)}, {list(labels.shape)}"
        )
    largest = min(max(ks), logits.shape[1])
    ranked = logits.float().cpu().topk(largest, dim=1, largest=True, sorted=True).indices
    correct = ranked == labels.cpu()[:, None]
    return {f"top{k}": correct[:, :k].any(dim=1).float().mean().item() for k in ks}


def classification_metrics(
    labels: Tensor, top: Tensor, predicted: Tensor, num_classes: int
) -> dict[str, float]:
    """ "top1", "top5" (with 5 classes or more, as clip_benchmark), "mean_per_class_recall" (sklearn's
    balanced accuracy of the arg-max class) and "num_samples", from each sample's ``top_classes`` row and
    arg-max class."""
    from sklearn.metrics import balanced_accuracy_score

    n = len(labels)
    if n == 0:
        raise ValueError("no sample to score")
    metrics = {"top1": int((top[:, 0] == labels).sum()) / n}
    if num_classes >= TOP_K:
        metrics["top5"] = int(top5_hits(labels, top).sum()) / n
    metrics["mean_per_class_recall"] = float(balanced_accuracy_score(labels.numpy(), predicted.numpy()))
    return {**metrics, "num_samples": n}


def top5_hits(labels: Tensor, top: Tensor) -> Tensor:
    """Whether each sample's label is among its ``top_classes`` (its top 5)."""
    return (top == labels[:, None]).any(dim=1)


def macro_f1(labels: Tensor, predicted: Tensor) -> float:
    """F1 averaged over the classes present in ``labels`` (WILDS' F1-macro, iWildCam's main metric)."""
    from sklearn.metrics import f1_score

    present = torch.unique(labels).numpy()
    return float(f1_score(labels.numpy(), predicted.numpy(), average="macro", labels=present))


def worst_group(hits: Tensor, groups: Tensor) -> float:
    """The lowest mean of ``hits`` over the groups that have samples (WILDS' "worst-group" metric), each
    mean in float32 as DataComp's ``_avg_over_groups`` takes it (a float32 sum over a float32 count)."""
    hits, groups = hits.float(), groups.long()
    means = [hits[groups == g].sum() / (groups == g).sum().float() for g in torch.unique(groups)]
    return float(min(means))


def retrieval_recall(
    image_features: Tensor,
    text_features: Tensor,
    text_to_image: Tensor,
    ks: Sequence[int] = (1, 5, 10),
    *,
    batch_size: int = 1024,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Image->text and text->image Recall@k, as clip_benchmark's retrieval evaluator computes them.

    ``image_features`` [N_img, d] and ``text_features`` [N_txt, d] are expected L2-normalised;
    ``text_to_image[j]`` is the index of the image described by caption j. An image may have several
    captions (it hits if any of them is in its top k); every image must have at least one. ``batch_size``
    rows of the score matrix go to ``device`` at a time (clip_benchmark: its loader's batch size, on the
    evaluation device). A k above the number of items counts as all of them (clip_benchmark fails).
    """
    images, texts = image_features.float().cpu(), text_features.float().cpu()
    num_images, num_texts = len(images), len(texts)
    text_to_image = text_to_image.cpu()
    if text_to_image.shape != (num_texts,):
        raise ValueError(f"text_to_image must have shape [{num_texts}], got {tuple(text_to_image.shape)}")
    if torch.bincount(text_to_image, minlength=num_images).min() == 0:
        raise ValueError("every image needs at least one caption for image->text recall to be defined")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")

    scores = texts @ images.T  # [N_txt, N_img], clip_benchmark's orientation
    metrics = {}
    # each recall is the hits' float32 mean, as clip_benchmark reports it (``.float().mean().item()``)
    for k in ks:
        # image->text: row i of scores.T is image i; a hit when one of its own captions is in its top k
        hits = _topk_hits(scores.T, k, batch_size, device, lambda rows, top: text_to_image[top] == rows)
        metrics[f"image_to_text_R@{k}"] = hits.float().mean().item()
    for k in ks:
        hits = _topk_hits(scores, k, batch_size, device, lambda rows, top: top == text_to_image[rows])
        metrics[f"text_to_image_R@{k}"] = hits.float().mean().item()
    return metrics


def _topk_hits(scores: Tensor, k: int, batch_size: int, device, matches) -> Tensor:
    """Per row of ``scores``: whether ``matches(rows [b, 1], top [b, k])`` holds for one of the row's top k
    items, ``topk`` taken on ``device`` ``batch_size`` rows at a time (clip_benchmark's ``batchify``)."""
    k = min(k, scores.shape[1])
    hits = []
    for start in range(0, len(scores), batch_size):
        rows = torch.arange(start, min(start + batch_size, len(scores)))
        top = scores[start : start + batch_size].to(device).topk(k, dim=1).indices.cpu()
        hits.append(matches(rows[:, None], top).any(dim=1))
    return torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool)
