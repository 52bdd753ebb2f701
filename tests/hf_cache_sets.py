"""Tiny WinoGAViL, Flickr and MSCOCO splits in the Hugging Face cache layout DataComp's download leaves
(datasets 2.8.0; checked against a cache that library wrote from a stand-in loading script: the same
folders, file names, Arrow schema and metadata):

    hf_cache/nlphuji___winogavil/TEST/1.1.0/<hash>/{winogavil-test.arrow, dataset_info.json}
    hf_cache/downloads/<sha256(url)>{,.json}            the CSV and the image archive, with their URLs
    hf_cache/downloads/extracted/<sha256>/winogavil_images/<candidate>.jpg
    hf_cache/nlphuji___flickr_1k_test_image_text_retrieval/TEST/1.1.0/<hash>/...-test.arrow  (image, caption)

The Arrow file is a stream whose image column holds absolute paths (no bytes) under the cache as it was
when written, ``written_at``: a cache moved since must be found again. Each image holds a feature vector
in its pixels (eval_sets.vector_png; PNG bytes, which PIL reads whatever the extension, so the features
survive exactly). ``make_instances`` makes WinoGAViL instances whose tied candidates tie exactly.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import numpy as np
from eval_sets import CAPTIONS, DIM, vector_png

from eva_fastclip.evaluation.winogavil import cue_prompt

BASE_URL = "https://huggingface.co/datasets/nlphuji/winogavil/resolve/main/"


CUES = ["Moon", "apple", "Owl", "fire", "winter", "ice", "sand", "unicorn", "gold", "echo", "tree", "rain"]


def make_instances(seed: int = 0) -> list[dict]:
    """Instances of 5, 6, 10, 12 and 7 candidates (7: in no size group). An image is a scaled axis, so
    its similarity with a cue is one component of the cue's unit vector, the same bits whichever the
    arithmetic: the images that repeat within an instance tie exactly, for the choice to break."""
    rng = np.random.default_rng(seed)
    instances = []
    for i, cue in enumerate(CUES):
        size = [5, 6, 10, 12, 7][i % 5]
        axes = rng.choice(DIM, 3, replace=False)  # 3 distinct images, each used often
        looks = np.eye(DIM)[axes] * rng.choice([0.5, 1.0, 2.0], (3, 1))
        vectors = looks[rng.integers(0, 3, size)]
        candidates = [f"{cue.lower()}_{j}" for j in range(size)]
        associations = list(rng.choice(candidates, int(rng.integers(2, size // 2 + 1)), replace=False))
        instances.append(
            {"cue": cue, "candidates": candidates, "associations": associations, "vectors": vectors.tolist()}
        )
        CAPTIONS[cue_prompt(cue)] = (np.round(rng.normal(size=DIM) * 4) / 4).tolist()
    return instances


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_winogavil_cache(
    hf_cache: Path,
    instances: list[dict],
    *,
    written_at: Path | None = None,
    prepared: bool = True,
) -> Path:
    """``instances``: dicts with "cue", "candidates", "associations" and "vectors" (one per candidate;
    a candidate name shared by two instances must have the same vector). Returns ``hf_cache``."""
    import pyarrow as pa

    written_at = written_at or hf_cache
    zip_name = _sha(BASE_URL + "winogavil_images.zip")
    extracted = f"downloads/extracted/{_sha(str(written_at / 'downloads' / zip_name))}/winogavil_images"
    (hf_cache / extracted).mkdir(parents=True, exist_ok=True)
    for instance in instances:
        for name, vector in zip(instance["candidates"], instance["vectors"]):
            (hf_cache / extracted / f"{name}.jpg").write_bytes(vector_png(vector))

    downloads = hf_cache / "downloads"
    (downloads / zip_name).write_bytes(b"PK\x05\x06" + bytes(18))  # the archive itself is not read
    (downloads / f"{zip_name}.json").write_text(json.dumps({"url": BASE_URL + "winogavil_images.zip"}))
    csv_name = _sha(BASE_URL + "winogavil_dataset.csv")
    with open(downloads / csv_name, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["", "candidates", "cue", "associations", "num_associations", "ID"])
        for i, instance in enumerate(instances):
            candidates, associations = instance["candidates"], instance["associations"]
            writer.writerow([i, json.dumps(candidates), instance["cue"], json.dumps(associations),
                             len(associations), i])  # fmt: skip
    (downloads / f"{csv_name}.json").write_text(json.dumps({"url": BASE_URL + "winogavil_dataset.csv"}))
    if not prepared:
        return hf_cache

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    features = {
        "candidates": [{"dtype": "string", "_type": "Value"}],
        "candidate_images": [{"_type": "Image"}],
        "cue": {"dtype": "string", "_type": "Value"},
        "associations": [{"dtype": "string", "_type": "Value"}],
        "num_associations": {"dtype": "int64", "_type": "Value"},
        "ID": {"dtype": "int64", "_type": "Value"},
    }
    columns = [
        ("candidates", pa.list_(pa.string())),
        ("candidate_images", pa.list_(image)),
        ("cue", pa.string()),
        ("associations", pa.list_(pa.string())),
        ("num_associations", pa.int64()),
        ("ID", pa.int64()),
    ]
    rows = [
        {
            "candidates": instance["candidates"],
            "candidate_images": [
                {"bytes": None, "path": str(written_at / extracted / f"{name}.jpg")}
                for name in instance["candidates"]
            ],
            "cue": instance["cue"],
            "associations": instance["associations"],
            "num_associations": len(instance["associations"]),
            "ID": i,
        }
        for i, instance in enumerate(instances)
    ]
    _write_prepared_split(hf_cache, "winogavil", columns, features, rows)
    return hf_cache


def write_retrieval_cache(
    hf_cache: Path, name: str, vectors, captions: list[list[str]], *, written_at: Path | None = None
) -> Path:
    """``nlphuji/<name>``'s test split as its loading script leaves it: per image its file (a path under
    the unpacked archive) and its caption list."""
    import pyarrow as pa

    written_at = written_at or hf_cache
    folder = f"downloads/extracted/{_sha(name)}/images_{name}"
    (hf_cache / folder).mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (vector, lines) in enumerate(zip(vectors, captions)):
        (hf_cache / folder / f"{i}.jpg").write_bytes(vector_png(vector))
        image = {"bytes": None, "path": str(written_at / folder / f"{i}.jpg")}
        rows.append({"image": image, "caption": lines, "filename": f"{i}.jpg"})
    features = {
        "image": {"_type": "Image"},
        "caption": [{"dtype": "string", "_type": "Value"}],
        "filename": {"dtype": "string", "_type": "Value"},
    }
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    columns = [("image", image_type), ("caption", pa.list_(pa.string())), ("filename", pa.string())]
    _write_prepared_split(hf_cache, name, columns, features, rows)
    return hf_cache


def _write_prepared_split(hf_cache: Path, name: str, columns, features: dict, rows: list[dict]) -> None:
    import pyarrow as pa

    schema = pa.schema(columns, metadata={"huggingface": json.dumps({"info": {"features": features}})})
    prepared_dir = hf_cache / f"nlphuji___{name}" / "TEST" / "1.1.0" / _sha("the loading script")
    prepared_dir.mkdir(parents=True)
    arrow = prepared_dir / f"{name}-test.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_pylist(rows, schema=schema))
    info = {"builder_name": name, "config_name": "TEST", "version": {"version_str": "1.1.0"}}
    info["splits"] = {"test": {"name": "test", "num_examples": len(rows), "dataset_name": name}}
    info["features"] = features
    (prepared_dir / "dataset_info.json").write_text(json.dumps(info))
