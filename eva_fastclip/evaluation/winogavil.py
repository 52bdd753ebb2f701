"""WinoGAViL, as DataComp evaluates it (mlfoundations/datacomp ``eval_utils/wino_eval.py`` at 4a8df19).

**Data.** The test split of ``nlphuji/winogavil`` that DataComp's ``download_evalsets.py`` caches under
``<datasets root>/hf_cache`` (hf_cache.py): the prepared Arrow file, or, where the split was never
prepared, the downloaded CSV (its list columns JSON-encoded) with the unpacked image archive. An instance
is a cue, its candidate images (5 to 12) and which candidates are true associations.

**Scoring**, per instance, as ``evaluate_winogavil_dataset`` does:

- the cue as one prompt: lower-cased, "An <cue>" when it starts with a vowel, else "A <cue>";
- the similarity of the prompt's normalised embedding with each candidate's, encoded as one batch of the
  instance's images (DataComp's loader gives one instance a batch);
- the k best candidates, k the number of true associations: ``np.argsort(similarities)[-k:]``. DataComp
  pins numpy 1.23, whose argsort sorts up to 16 elements by insertion: stably, so among equal scores the
  later candidate is taken. We sort stably, which is that order (and stays so under newer numpy, whose
  vectorised argsort is not stable);
- the instance's score: the Jaccard index of the chosen and the true candidates (sklearn's
  ``jaccard_score``: 0 where both are empty). With no true association, ``[-0:]`` chooses every
  candidate, as there;
- ``avg_jaccard_score`` over the instances, ``jaccard_score_<n>`` over those with n candidates (5, 6, 10,
  12), ``jaccard_score_5-6`` (at most 6) and ``jaccard_score_10-12`` (at least 10: DataComp's main
  metric), each a numpy mean in instance order. A group without instances is None (DataComp: NaN).

Under ``autocast_dtype`` the encoders, the normalisation and the similarity run under autocast, as
DataComp runs them under ``torch.cuda.amp.autocast`` (fp16 on a GPU; on a CPU that autocast does nothing).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset
from tqdm import tqdm

from .collectives import Collectives, SingleRank, gather_rows, run_everywhere
from .hf_cache import cached_downloads, prepared_split, read_arrow_rows, remap_cached_path
from .samples import IMAGE_EXTENSIONS, decode_image, worker_loader
from .zeroshot import _autocast, _eval_mode, _input_dtype

REPO = "nlphuji/winogavil"
#: DataComp's metrics: name -> which instance sizes (numbers of candidates) it averages over
GROUPS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "jaccard_score_5": lambda sizes: sizes == 5,
    "jaccard_score_6": lambda sizes: sizes == 6,
    "jaccard_score_10": lambda sizes: sizes == 10,
    "jaccard_score_12": lambda sizes: sizes == 12,
    "jaccard_score_5-6": lambda sizes: sizes <= 6,
    "jaccard_score_10-12": lambda sizes: sizes >= 10,
}
MAIN_METRIC = "jaccard_score_10-12"
_CSV_COLUMNS = ("candidates", "cue", "associations")

ImageSource = Path | bytes


@dataclass(frozen=True, slots=True)
class Instance:
    """One WinoGAViL instance: the cue, its candidates, which of them the cue is associated with, and
    where each candidate's image is (a file, or the bytes the Arrow file holds)."""

    cue: str
    candidates: tuple[str, ...]
    truth: tuple[bool, ...]
    images: tuple[ImageSource, ...]


def find_winogavil(hf_cache: str | os.PathLike) -> Path | None:
    """What WinoGAViL is read from under ``hf_cache``: its prepared Arrow file, else its cached CSV; None
    when neither is there."""
    files = prepared_split(hf_cache, REPO)
    if files:
        return files[0]
    return _cached_csv(hf_cache)


def read_winogavil(hf_cache: str | os.PathLike) -> list[Instance]:
    """The instances of WinoGAViL's test split, in the split's order. FileNotFoundError or ValueError
    naming what is missing or malformed."""
    hf_cache = Path(hf_cache)
    files = prepared_split(hf_cache, REPO)
    if files:
        rows, source = list(read_arrow_rows(files)), files[0]
    else:
        source = _cached_csv(hf_cache)
        if source is None:
            raise FileNotFoundError(
                f"{hf_cache}: no {REPO} test split (neither nlphuji___winogavil/*/*/*/winogavil-test.arrow "
                "nor its downloaded CSV); DataComp's download_evalsets.py puts it there"
            )
        rows = _csv_rows(source)
    if not rows:
        raise ValueError(f"{source}: WinoGAViL's test split has no instance")
    by_stem = None
    instances = []
    for number, row in enumerate(rows):
        missing = [column for column in _CSV_COLUMNS if column not in row]
        if missing:
            raise ValueError(f"{source}: instance {number} has no {', '.join(missing)}")
        candidates = tuple(str(c) for c in row["candidates"])
        if not str(row["cue"]).strip() or not candidates:
            raise ValueError(f"{source}: instance {number} has an empty cue or no candidate")
        stored = row.get("candidate_images")
        if stored is not None:
            if len(stored) != len(candidates):
                raise ValueError(
                    f"{source}: instance {number} has {len(candidates)} candidates and {len(stored)} images"
                )
            images = tuple(_image_source(image, hf_cache) for image in stored)
        else:  # the CSV: the images by name in the unpacked archive
            by_stem = by_stem if by_stem is not None else _extracted_images(hf_cache, rows, source)
            images = tuple(by_stem[candidate] for candidate in candidates)
        associations = set(row["associations"])
        truth = tuple(candidate in associations for candidate in candidates)
        instances.append(Instance(str(row["cue"]), candidates, truth, images))
    return instances


def cue_prompt(cue: str) -> str:
    """DataComp's prompt for a cue (``get_clip_prompt``)."""
    cue = cue.lower()
    return f"An {cue}" if cue[0] in "aeiou" else f"A {cue}"


def jaccard_of_choice(similarities: np.ndarray, truth: np.ndarray) -> float:
    """One instance's score: the Jaccard index of the k most similar candidates (k = the number of true
    ones; ties to the later candidate, see the module docstring) and the true candidates."""
    truth = np.asarray(truth, dtype=bool)
    k = int(truth.sum())
    chosen = np.zeros(len(truth), dtype=bool)
    chosen[np.argsort(similarities, kind="stable")[-k:]] = True  # k = 0: [-0:] is every candidate
    union = int((chosen | truth).sum())
    return int((chosen & truth).sum()) / union if union else 0.0


def winogavil_metrics(scores: Sequence[float], sizes: Sequence[int]) -> dict[str, float | int | None]:
    """DataComp's metrics from the instances' scores and numbers of candidates, in instance order."""
    scores, sizes = np.asarray(scores, dtype=np.float64), np.asarray(sizes)
    if not len(scores):
        raise ValueError("no WinoGAViL instance to score")
    metrics: dict[str, float | int | None] = {"avg_jaccard_score": float(scores.mean())}
    for name, members in GROUPS.items():
        group = scores[members(sizes)]
        metrics[name] = float(group.mean()) if len(group) else None
    return {**metrics, "num_samples": len(scores)}


@torch.no_grad()
def evaluate_winogavil(
    model: nn.Module,
    tokenize: Callable[[list[str]], Tensor],
    instances: Sequence[Instance],
    *,
    preprocess: Callable[..., Tensor],
    device: torch.device | str,
    autocast_dtype: torch.dtype | None = None,
    workers: int = 0,
    collectives: Collectives | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """DataComp's WinoGAViL metrics of ``model`` (``winogavil_metrics``). Rank r of W scores the instances
    i ≡ r (mod W); every rank returns the same result, equal to one rank's. An unreadable image stops the
    evaluation on every rank, naming it (a skipped instance would change every mean)."""
    collectives = collectives or SingleRank()
    own = list(range(collectives.rank, len(instances), collectives.world_size))

    def score_own() -> Tensor:
        rows = []
        loader = _instance_loader(instances, own, preprocess, workers)
        with _eval_mode(model):
            for number, images in tqdm(loader, desc="WinoGAViL", total=len(own), disable=not progress):
                instance = instances[number]
                tokens = tokenize([cue_prompt(instance.cue)]).to(device)
                images = images.to(device, _input_dtype(model))
                with _autocast(device, autocast_dtype):
                    image_features = F.normalize(model.encode_image(images), dim=-1)
                    text_features = F.normalize(model.encode_text(tokens), dim=-1)
                    similarities = (text_features @ image_features.T).squeeze(0)
                score = jaccard_of_choice(similarities.float().cpu().numpy(), np.array(instance.truth))
                rows.append([number, score, len(instance.candidates)])
        return torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)

    mine = run_everywhere(collectives, device, score_own)
    every = gather_rows(collectives, mine, device).cpu()
    every = every[every[:, 0].argsort()]
    return winogavil_metrics(every[:, 1].tolist(), every[:, 2].long().tolist())


class _InstanceImages(Dataset):
    """Instance i's candidate images, preprocessed, as one batch."""

    def __init__(self, instances: Sequence[Instance], preprocess: Callable[..., Tensor]) -> None:
        self.instances, self.preprocess = instances, preprocess

    def __len__(self) -> int:
        return len(self.instances)

    def __getitem__(self, number: int) -> tuple[int, Tensor]:
        images = []
        for source in self.instances[number].images:
            try:
                data = source if isinstance(source, bytes) else Path(source).read_bytes()
                images.append(self.preprocess(decode_image(data)))
            except Exception as err:
                where = "an image stored in the Arrow file" if isinstance(source, bytes) else str(source)
                raise ValueError(f"WinoGAViL instance {number}: cannot read {where}: {err!r}") from err
        return number, torch.stack(images)


def _instance_loader(instances, own: list[int], preprocess, workers: int):
    dataset = _InstanceImages(instances, preprocess)
    return worker_loader(dataset, len(own), workers, sampler=own, batch_size=None)  # an instance a batch


def _image_source(image: Any, hf_cache: Path) -> ImageSource:
    """An ``Image()`` value of the Arrow file: its bytes, else its file (found again if the cache moved)."""
    if isinstance(image, dict):
        if image.get("bytes"):
            return bytes(image["bytes"])
        image = image.get("path")
    if not isinstance(image, str) or not image:
        raise ValueError(f"{hf_cache}: a WinoGAViL candidate image has neither bytes nor a path")
    return remap_cached_path(image, hf_cache)


def _cached_csv(hf_cache: str | os.PathLike) -> Path | None:
    """The downloaded CSV of WinoGAViL: a cached .csv download whose URL names winogavil."""
    for url, file in cached_downloads(hf_cache).items():
        name = url.rsplit("/", 1)[-1].lower()
        if "winogavil" in url.lower() and name.endswith(".csv"):
            return file
    return None


def _csv_rows(path: Path) -> list[dict[str, Any]]:
    import csv

    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if rows and any(column not in rows[0] for column in _CSV_COLUMNS):
        raise ValueError(f"{path}: WinoGAViL's CSV needs the columns {', '.join(_CSV_COLUMNS)}")
    for number, row in enumerate(rows):
        for column in ("candidates", "associations"):
            try:
                row[column] = json.loads(row[column])
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: row {number}: {column} is not a JSON list ({err})") from err
    return rows


def _extracted_images(hf_cache: Path, rows: list[dict[str, Any]], source: Path) -> dict[str, Path]:
    """Candidate name -> image file, from the unpacked archive under ``downloads/extracted`` that holds
    every candidate's image (``<name>.jpg`` or another image extension)."""
    wanted = {str(candidate) for row in rows for candidate in row["candidates"]}
    best: dict[str, Path] = {}
    extracted = Path(hf_cache) / "downloads" / "extracted"
    for folder in sorted(extracted.iterdir()) if extracted.is_dir() else []:
        found = {}
        for path in folder.rglob("*"):
            if path.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS and path.stem in wanted:
                found.setdefault(path.stem, path)
        if len(found) > len(best):
            best = found
    missing = sorted(wanted - set(best))
    if missing:
        raise FileNotFoundError(
            f"{source}: no image for {len(missing)} of the {len(wanted)} candidates under {extracted} "
            f"(e.g. {missing[0]!r}); the image archive is unpacked there by the datasets library"
        )
    return best


__all__ = [
    "GROUPS",
    "MAIN_METRIC",
    "REPO",
    "Instance",
    "cue_prompt",
    "evaluate_winogavil",
    "find_winogavil",
    "jaccard_of_choice",
    "read_winogavil",
    "winogavil_metrics",
]
