"""Which caption a sample trains with, where it has several (alt-text and synthetic rewrites: LaCLIP,
VeCLIP, DreamLIP, DataComp's recaptioned pools).

``data.caption_keys`` names where captions are: a member's extension (``txt``, ``caption``) or a field of
the sample's ``.json`` (``json:recaption``). Of those a sample has, usable ones only (UTF-8, not empty on
their first line):

- without ``data.caption_weights``, the first in the keys' order (a priority order);
- with them, one drawn by the weights of the keys present (renormalised over them). The draw is seeded by
  the sample's key (data/sample_keys.py: the run's seed, the epoch, the sample, its occurrence), so a
  sample gets the same caption on any number of ranks and loader workers and after a resume, and may get
  another the next epoch. OpenCLIP's draw (``--json-text-key-probs``) uses each worker's own random state,
  so which caption a sample gets there depends on the layout.

A sample with none of the keys is ``incomplete``; one whose captions are all empty or all not UTF-8 is
``empty_caption`` or ``non_utf8_caption`` (skipped and counted: docs/data.md, Corrupt samples).
Evaluation on shards of the training layout reads the first key.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from .tar_reader import first_line

JSON_PREFIX = "json:"


@dataclass(frozen=True)
class Captions:
    """The caption keys and, for a weighted draw, their weights (None: the first present wins)."""

    keys: tuple[str, ...] = ("txt",)
    weights: tuple[float, ...] | None = None

    @property
    def members(self) -> set[str]:
        """The sample members captions are read from."""
        return {"json" if key.startswith(JSON_PREFIX) else key for key in self.keys}

    def choose(self, sample: dict[str, Any], key: int) -> tuple[str | None, str]:
        """(the caption, "") or (None, the reason it has none: one of the skip reasons) of ``sample``, whose
        sample key is ``key``."""
        found = self._found(sample)
        if not found:
            return None, "incomplete"
        usable = [(weight, text) for weight, text in found if text]
        if not usable:
            return None, "non_utf8_caption" if all(text is None for _, text in found) else "empty_caption"
        if self.weights is None or len(usable) == 1:
            return usable[0][1], ""
        weights = [weight for weight, _ in usable]
        return random.Random(f"caption:{key}").choices(usable, weights=weights)[0][1], ""

    def _found(self, sample: dict[str, Any]) -> list[tuple[float, str | None]]:
        """(weight, first line: "" when empty, None when not UTF-8) of each key the sample has."""
        meta: Any = None
        found = []
        for place, name in enumerate(self.keys):
            weight = 1.0 if self.weights is None else self.weights[place]
            if name.startswith(JSON_PREFIX):
                if meta is None:
                    meta = _json(sample)
                value = meta.get(name[len(JSON_PREFIX) :]) if isinstance(meta, dict) else None
                if isinstance(value, str):
                    found.append((weight, first_line(value)))
            elif name in sample:
                try:
                    found.append((weight, first_line(sample[name].decode("utf-8"))))
                except UnicodeDecodeError:
                    found.append((weight, None))
        return found

    def describe(self) -> str:
        return ", ".join(f".{key}" if not key.startswith(JSON_PREFIX) else key for key in self.keys)


def _json(sample: dict[str, Any]) -> Any:
    try:
        return json.loads(sample["json"]) if "json" in sample else False
    except ValueError:  # not JSON, or not UTF-8
        return False
