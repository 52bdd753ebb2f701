"""Data layer: toy dataset, shard writing (make-shards) and webdataset loaders."""

from .pipeline import TrainLoader, build_classification_loader, build_retrieval_loader, expand_urls
from .shards import ManifestTotals, manifest_totals, read_manifest, write_manifest, write_shard, write_shards
from .toy import TOY_CLASSNAMES, TOY_TEMPLATES, toy_classnames, toy_templates, write_toy_dataset

__all__ = [
    "TOY_CLASSNAMES",
    "TOY_TEMPLATES",
    "ManifestTotals",
    "TrainLoader",
    "build_classification_loader",
    "build_retrieval_loader",
    "expand_urls",
    "manifest_totals",
    "read_manifest",
    "toy_classnames",
    "toy_templates",
    "write_manifest",
    "write_shard",
    "write_shards",
    "write_toy_dataset",
]
