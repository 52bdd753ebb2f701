"""Zero-shot classification, image-text retrieval and DataComp's benchmark suite, on every rank with its
share (an unwrapped model; the ranks meet only through a ``Collectives`` object: collectives.py)."""

from .collectives import Collectives, EvaluationFailed, SingleRank, run_everywhere
from .datacomp import TASKS, evaluate_datacomp, format_datacomp
from .metrics import classification_metrics, retrieval_recall, top_classes, topk_accuracy
from .sets import ClassificationSet, RetrievalSet, read_imagenet_folder, read_pair_shards, read_wds_folder
from .zeroshot import (
    Predictions,
    build_zeroshot_classifier,
    classify,
    fill_template,
    retrieve,
    zeroshot_classify,
)

__all__ = [
    "TASKS",
    "ClassificationSet",
    "Collectives",
    "EvaluationFailed",
    "Predictions",
    "RetrievalSet",
    "SingleRank",
    "build_zeroshot_classifier",
    "classification_metrics",
    "classify",
    "zeroshot_classify",
    "evaluate_datacomp",
    "fill_template",
    "format_datacomp",
    "read_imagenet_folder",
    "read_pair_shards",
    "read_wds_folder",
    "retrieval_recall",
    "retrieve",
    "run_everywhere",
    "top_classes",
    "topk_accuracy",
]
