"""`eva-fastclip tune`: the layout of a recipe that fits the user's GPUs and trains fastest (tuner.py)."""

from eva_fastclip.tune.options import TuneOptions
from eva_fastclip.tune.tuner import Tuner

__all__ = ["TuneOptions", "Tuner"]
