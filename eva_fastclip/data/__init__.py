"""Data layer: toy dataset, shard writing (make-shards), size records and the training loader."""

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
    "expand_urls",
    "read_manifest",
    "resolve_sizes",
    "toy_classnames",
    "toy_templates",
    "write_manifest",
    "write_shard",
    "write_shards",
    "write_toy_dataset",
]
