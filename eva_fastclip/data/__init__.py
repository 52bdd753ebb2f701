"""Data layer: toy dataset, shard writing (make-shards), size records and webdataset loaders."""

from .pipeline import TrainLoader, build_classification_loader, build_retrieval_loader, expand_urls
from .shards import read_manifest, write_manifest, write_shard, write_shards
from .sizes import DataSizes, resolve_sizes
from .toy import TOY_CLASSNAMES, TOY_TEMPLATES, toy_classnames, toy_templates, write_toy_dataset

__all__ = [
    "TOY_CLASSNAMES",
    "TOY_TEMPLATES",
    "DataSizes",
    "TrainLoader",
    "build_classification_loader",
    "build_retrieval_loader",
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
