"""The evaluation sets we read, each as numbered samples (``samples.StoredSample``) and what to score them
against; nothing here downloads.

- A clip_benchmark webdataset folder (``test/nshards.txt``, ``test/{0..n-1}.tar``, ``classnames.txt``,
  ``zeroshot_classification_templates.txt``, ``dataset_type.txt``): its shard list, class names, prompts
  and type come from clip_benchmark's own builder, so a folder it refuses is refused here too. A folder
  without ``nshards.txt`` (the layout ``eval.zeroshot_dir`` accepted before) is read from ``test/*.tar``.
- A retrieval split of a Hugging Face cache (``read_hf_retrieval_split``): DataComp's Flickr and MSCOCO.
- Image-text shards in the training layout (``eval.retrieval_shards``): the first caption line per image.
- An ImageNet validation folder ``DIR/<wnid>/*.JPEG`` (OpenCLIP's ``--imagenet-val``) read as torchvision's
  ImageFolder reads it, scored with open_clip's class names and OpenAI's 80 prompts. The wnids come from
  timm's ImageNet-1k synset list (sorted wnids are the standard class order); a folder holding some of
  the 1000 wnids is scored over those classes, and says so.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eva_fastclip.data import expand_urls
from eva_fastclip.data.captions import JSON_PREFIX

from .samples import IMAGE_EXTENSIONS, StoredSample, index_tar_shards

log = logging.getLogger(__name__)

_CLASSIFICATION_PARTS = {*IMAGE_EXTENSIONS, "cls", "npy"}
_RETRIEVAL_PARTS = {*IMAGE_EXTENSIONS, "txt"}
#: how a zero-shot prompt template marks the class name: clip_benchmark's "{c}", or "{}"
TEMPLATE_PLACEHOLDERS = ("{c}", "{}")


@dataclass(frozen=True, slots=True)
class ClassificationSet:
    """Images with one class each; ``target`` gives (label, the sample's metadata row or None)."""

    name: str
    samples: list[StoredSample]
    classnames: list[str]
    templates: list[str]
    note: str = ""
    """Said beside the result, e.g. that a folder holds only some of a benchmark's classes."""

    def target(self, parts: dict[str, bytes], sample: StoredSample) -> tuple[int, np.ndarray | None]:
        label = sample.label if sample.label is not None else int(parts["cls"])
        metadata = np.load(io.BytesIO(parts["npy"])) if "npy" in parts else None
        return label, metadata


@dataclass(frozen=True, slots=True)
class RetrievalSet:
    """Images with one or more captions each; ``target`` gives the captions."""

    name: str
    samples: list[StoredSample]
    every_line: bool
    """Every line of the .txt is a caption (clip_benchmark's retrieval folders); else only the first."""
    caption_key: str = "txt"
    """Where the caption is: a member's extension, or a .json field ("json:caption"): data.caption_keys'
    first for shards of the training layout."""

    def target(self, parts: dict[str, bytes], sample: StoredSample) -> list[str]:
        if sample.captions is not None:  # a Hugging Face split: the captions are in its rows
            return list(sample.captions)
        if self.caption_key.startswith(JSON_PREFIX):
            text = json.loads(parts["json"])[self.caption_key[len(JSON_PREFIX) :]]
        else:
            text = parts[self.caption_key].decode("utf-8")
        return text.splitlines() if self.every_line else [text.strip().split("\n", 1)[0].strip()]


def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (clip_benchmark layout expected)")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line]


def read_classification_folder(dataset_dir: str | os.PathLike) -> tuple[list[str], list[str], list[str]]:
    """The shards, class names and prompt templates of a clip_benchmark-layout classification folder.

    Reads the names of ``dataset_dir/test/*.tar``, ``classnames.txt`` (one class per line) and
    ``zeroshot_classification_templates.txt`` (one template per line). A template marks the class name
    with "{c}", as clip_benchmark's files do, or "{}" (clip_benchmark's builder rewrites such prompts to
    "{c}"; ``evaluation.fill_template`` fills either). FileNotFoundError or ValueError naming the file.
    """
    root = Path(dataset_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root}: no such folder (clip_benchmark layout expected: test/*.tar, classnames.txt, "
            "zeroshot_classification_templates.txt)"
        )
    shards = sorted(glob.glob(os.path.join(glob.escape(str(root / "test")), "*.tar")))
    if not shards:
        raise FileNotFoundError(f"{root / 'test'}: no *.tar shards (clip_benchmark layout expected)")
    classnames = _read_lines(root / "classnames.txt")
    if not classnames:
        raise ValueError(f"{root / 'classnames.txt'} names no class")
    templates = _read_lines(root / "zeroshot_classification_templates.txt")
    bad = [template for template in templates if not any(p in template for p in TEMPLATE_PLACEHOLDERS)]
    if bad or not templates:
        raise ValueError(
            f"{root / 'zeroshot_classification_templates.txt'}: every line needs a {{c}} or {{}} placeholder "
            "for the class name" + (f" ({bad[0]!r} has none)" if bad else " (the file has no line)")
        )
    return shards, classnames, templates


def read_wds_folder(root: str | os.PathLike, name: str | None = None) -> ClassificationSet | RetrievalSet:
    """A clip_benchmark webdataset folder (see the module docstring). FileNotFoundError or ValueError
    naming the file that is missing or wrong."""
    root = Path(root)
    name = name or root.name
    if not (root / "test" / "nshards.txt").is_file():
        shards, classnames, templates = read_classification_folder(root)  # the older layout
        samples = _index(_numeric_order(shards), _CLASSIFICATION_PARTS)
        return ClassificationSet(name, samples, classnames, templates)

    from clip_benchmark.datasets.builder import build_wds_dataset

    dataset_type = _dataset_type(root)
    if dataset_type == "multilabel":
        raise ValueError(f"{root}: multi-label sets (dataset_type.txt 'multilabel') are not evaluated here")
    with warnings.catch_warnings():  # webdataset's note on shard shuffling: we read the shards ourselves
        warnings.simplefilter("ignore", UserWarning)
        built = build_wds_dataset(name, transform=None, split="test", data_dir=str(root))
    nshards = int((root / "test" / "nshards.txt").read_text())
    shards = [str(root / "test" / f"{i}.tar") for i in range(nshards)]  # clip_benchmark's {0..n-1}.tar
    missing = [shard for shard in shards if not os.path.isfile(shard)]
    if missing:
        raise FileNotFoundError(f"{root}: test/nshards.txt says {nshards} shards, {missing[0]} is missing")
    if dataset_type == "retrieval":
        return RetrievalSet(name, _index(shards, _RETRIEVAL_PARTS), every_line=True)
    # blank lines are no class and no prompt (clip_benchmark 1.6 keeps them); a blank class line before
    # the last class would leave the .cls labels, which index the lines, ambiguous: refused
    classnames = list(built.classes or [])
    while classnames and not classnames[-1].strip():
        classnames.pop()
    if any(not c.strip() for c in classnames):
        line = next(i for i, c in enumerate(classnames) if not c.strip()) + 1
        raise ValueError(
            f"{root / 'classnames.txt'}: line {line} is blank, before the last class; the .cls labels "
            "number the lines, so a blank one leaves it unclear which class each label means"
        )
    templates = [t for t in built.templates or [] if t.strip()]
    for what, value, file in (
        ("class names", classnames, "classnames.txt"),
        ("prompt templates", templates, "zeroshot_classification_templates.txt"),
    ):
        if not value:
            raise FileNotFoundError(f"{root / file}: missing or empty; a classification folder needs {what}")
    return ClassificationSet(name, _index(shards, _CLASSIFICATION_PARTS), classnames, templates)


def read_hf_retrieval_split(files: list[Path], hf_cache: str | os.PathLike, name: str) -> RetrievalSet:
    """A retrieval split of the Hugging Face cache (hf_cache.py), as DataComp reads Flickr and MSCOCO
    (``nlphuji/*_image_text_retrieval``): each row's ``image`` (its file, found again if the cache moved)
    and its ``caption`` list, in the split's order."""
    from .hf_cache import read_arrow_rows, remap_cached_path

    samples = []
    for number, row in enumerate(read_arrow_rows(files)):
        image, captions = row.get("image"), row.get("caption")
        path = image.get("path") if isinstance(image, dict) else None
        if not path or not captions or not isinstance(captions, list):
            raise ValueError(
                f"{files[0]}: row {number} needs an image file and a caption list (the nlphuji retrieval "
                "splits' 'image' and 'caption'); images stored as bytes are not read"
            )
        samples.append(StoredSample(str(remap_cached_path(path, hf_cache)), captions=tuple(captions)))
    if not samples:
        raise ValueError(f"{files[0]}: the split has no row")
    return RetrievalSet(name, samples, every_line=True)


def read_pair_shards(
    sources: str | list[str], name: str = "retrieval", caption_key: str = "txt"
) -> RetrievalSet:
    """Image-text shards in the training layout; the first line of each caption (``caption_key``: the
    .txt, another member, or a .json field) is the image's caption."""
    member = "json" if caption_key.startswith(JSON_PREFIX) else caption_key
    samples = _index(expand_urls(sources), {*IMAGE_EXTENSIONS, member})
    return RetrievalSet(name, samples, every_line=False, caption_key=caption_key)


def read_imagenet_folder(root: str | os.PathLike) -> ClassificationSet:
    """``root/<wnid>/*.JPEG`` (any image extension torchvision's ImageFolder reads), scored over the 1000
    ImageNet classes or over the subset of them that ``root`` holds."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES
    from timm.data import ImageNetInfo
    from torchvision.datasets import ImageFolder

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder (an ImageNet validation folder <wnid>/*.JPEG)")
    wnids = ImageNetInfo("imagenet-1k").label_names()
    index = {wnid: i for i, wnid in enumerate(wnids)}
    folders = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    unknown = [folder for folder in folders if folder not in index]
    if unknown or not folders:
        found = f"{len(unknown)} folder(s) are no ImageNet-1k wnid, e.g. {unknown[0]!r}" if unknown else ""
        raise ValueError(
            f"{root}: {found or 'no class folder'}; expected one folder per class named by its wnid "
            "(n01440764/, ...) holding its images, as torchvision's ImageFolder and OpenCLIP's "
            "--imagenet-val read them"
        )
    try:
        folder = ImageFolder(str(root))
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{root}: {err}") from err
    samples = [StoredSample(path, label=label) for path, label in folder.samples]
    classnames = [IMAGENET_CLASSNAMES[index[wnid]] for wnid in folder.classes]
    templates = [template("{c}") for template in OPENAI_IMAGENET_TEMPLATES]
    note = ""
    if len(folder.classes) < len(wnids):
        note = f"{len(folder.classes)} of the {len(wnids)} ImageNet classes (those {root} holds)"
        log.warning("ImageNet zero-shot on %s: scored over %s", root, note)
    return ClassificationSet("imagenet", samples, classnames, templates, note=note)


def _dataset_type(root: Path) -> str:
    path = root / "dataset_type.txt"
    return path.read_text().strip().lower() if path.is_file() else "classification"


def _index(shards: list[str], parts: set[str]) -> list[StoredSample]:
    return index_tar_shards(shards, lambda extension: extension in parts)


def _numeric_order(shards: list[str]) -> list[str]:
    """test/*.tar as clip_benchmark's {0..n-1}.tar reads them ("10.tar" after "9.tar"); other names after
    those, in name order."""

    def key(path: str) -> tuple[int, int, str]:
        match = re.fullmatch(r"(\d+)\.tar", os.path.basename(path))
        return (0, int(match.group(1)), "") if match else (1, 0, path)

    return sorted(shards, key=key)
