"""Data layer: toy dataset, shard writing (make-shards), size records and webdataset loaders."""

from .eval_loaders import build_classification_loader, build_retrieval_loader, read_classification_folder
from .shards import read_manifest, write_manifest, write_shard, write_shards
from .sizes import DataSizes, resolve_sizes
from .toy import TOY_CLASSNAMES, TOY_TEMPLATES, toy_classnames, toy_templates, write_toy_dataset
from .train_loader import TrainLoader
from .urls import expand_urls

__all__ = [
    "TOY_CLASSNAMES",
    "TOY_TEMPLATES",
    "DataSizes",
    "TrainLoader",
    "build_classification_loader",
    "build_retrieval_loader",
    "expand_urls",
    "read_classification_folder",
    "read_manifest",
    "resolve_sizes",
    "toy_classnames",
    "toy_templates",
    "write_manifest",
    "write_shard",
    "write_shards",
    "write_toy_dataset",
]
