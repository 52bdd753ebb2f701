"""``eva-fastclip train`` for launcher tests (``deepspeed --num_gpus N tests/launched_train.py train ...``),
with hooks that environment variables switch on. The product has no such hooks; they are wrapped around
it here.

- ``EVA_TEST_POISON=RANK:STEP,STEP``: that rank's micro-batches of those optimizer steps (1-based) get a NaN
  image, so the loss and the gradients turn non-finite on that rank alone (then, through the gather and the
  gradient all-reduce, everywhere).
- ``EVA_TEST_RECORD=FOLDER``: every rank writes ``FOLDER/rank_K.json`` as it leaves: its exit code and, if
  it stopped for non-finite steps, the step and the message; rank 0 writes ``FOLDER/saved_STEP.json`` after
  each save: the SHA-256 of every file of the checkpoint, and ``FOLDER/listed_STEP.json``: the names in the
  checkpoints folder then.
- ``EVA_TEST_LIMIT_FILE_SIZE=BYTES``: after its first save, every rank (or only rank ``EVA_TEST_LIMIT_RANK``),
  and what it starts from then on, may write at most BYTES to a file (RLIMIT_FSIZE, ``ulimit -f``): the kernel
  refuses a larger write with EFBIG (Python ignores SIGXFSZ), as a full file system refuses it with ENOSPC.
- ``EVA_TEST_FILL_AT_START=BYTES``: once its Trainer is built, rank 0 fills the file system of the output
  folder (a file ``filler`` there) until BYTES are left.
- ``EVA_TEST_DUMP_LOADED=FOLDER``: once the trainer is set up (a resume loaded), every rank writes
  ``FOLDER/rank_K.pt``: its optimizer steps per group and, on rank 0, the full fp32 weights and moments of
  every trained parameter, gathered from the ZeRO partitions by DeepSpeed's own accessors
  (:func:`loaded_state`, which tests call on a Trainer of their own process too).
"""

import hashlib
import json
import os
import resource
import shutil
import sys
from pathlib import Path

import torch

from eva_fastclip.cli import main
from eva_fastclip.engine.trainer import Trainer
from eva_fastclip.reliability.bad_steps import NonFiniteSteps

RANK = int(os.environ.get("RANK", "0"))
stopped: dict = {}


def poison(spec: str) -> None:
    rank, steps = spec.split(":")
    steps = {int(step) for step in steps.split(",")}
    real = Trainer.train_step

    def train_step(self, images, tokens, indices, keys=None):
        if self.rank == int(rank) and self.step + 1 in steps:
            # the model's input (uint8 from the loader is normalised on the device), with a NaN image
            images = self.loader.to_device(images, self.device, self.input_dtype).clone()
            images[0] = float("nan")
        return real(self, images, tokens, indices, keys)

    Trainer.train_step = train_step


def record_stop() -> None:
    real = Trainer.train

    def train(self):
        try:
            return real(self)
        except NonFiniteSteps as err:
            stopped.update(step=self.step, message=str(err))
            raise

    Trainer.train = train


def record_saves(folder: Path) -> None:
    real = Trainer.save

    def save(self):
        saved = real(self)
        if self.is_main:
            files = sorted(path for path in saved.rglob("*") if path.is_file())
            digest = {str(p.relative_to(saved)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"saved_{self.step}.json").write_text(json.dumps(digest))
            listed = sorted(path.name for path in saved.parent.iterdir())
            (folder / f"listed_{self.step}.json").write_text(json.dumps(listed))
        return saved

    Trainer.save = save


def limit_file_size_after_first_save(limit: int) -> None:
    real = Trainer.save

    def save(self):
        saved = real(self)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # the same limit again: no change
        return saved

    Trainer.save = save


def fill_at_start(left: int) -> None:
    real = Trainer.__init__

    def __init__(self, *args, **kwargs):
        real(self, *args, **kwargs)
        if self.is_main:
            filler = self.output_dir / "filler"
            with open(filler, "wb") as f:
                chunk, remaining = bytes(2**20), shutil.disk_usage(filler.parent).free - left
                while remaining > 0:
                    remaining -= f.write(chunk[: min(len(chunk), remaining)])

    Trainer.__init__ = __init__


def loaded_state(trainer: Trainer) -> dict:
    """The trainer's optimizer steps per group and, on rank 0, the full fp32 weights and moments of every
    trained parameter, gathered from the ZeRO partitions by DeepSpeed's own accessors (collectives: every
    rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    params = {}
    for name, param in trainer.engine.module.named_parameters():
        if param.requires_grad:  # collectives: every rank gathers every parameter, in the same order
            params[name] = {
                "fp32": safe_get_full_fp32_param(param).clone(),
                "exp_avg": safe_get_full_optimizer_state(param, "exp_avg").clone(),
                "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq").clone(),
            }
    base = trainer.engine.optimizer.optimizer  # ZeRO's wrapper holds the optimizer that steps
    steps = [int(base.state[group["params"][0]]["step"]) for group in base.param_groups]
    return {"steps": steps, "params": params if trainer.is_main else {}}


def dump_loaded(folder: Path) -> None:
    real = Trainer.__init__

    def __init__(self, *args, **kwargs):
        real(self, *args, **kwargs)
        state = loaded_state(self)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, folder / f"rank_{RANK}.pt")

    Trainer.__init__ = __init__


if __name__ == "__main__":
    if os.environ.get("EVA_TEST_POISON"):
        poison(os.environ["EVA_TEST_POISON"])
    if os.environ.get("EVA_TEST_DUMP_LOADED"):
        dump_loaded(Path(os.environ["EVA_TEST_DUMP_LOADED"]))
    record_stop()
    limited = os.environ.get("EVA_TEST_LIMIT_RANK", str(RANK)) == str(RANK)  # every rank, or the one named
    if os.environ.get("EVA_TEST_LIMIT_FILE_SIZE") and limited:
        limit_file_size_after_first_save(int(os.environ["EVA_TEST_LIMIT_FILE_SIZE"]))
    if os.environ.get("EVA_TEST_FILL_AT_START"):
        fill_at_start(int(os.environ["EVA_TEST_FILL_AT_START"]))
    if os.environ.get("EVA_TEST_RECORD"):  # its few bytes a save fit under the limit
        record_saves(Path(os.environ["EVA_TEST_RECORD"]))
    code = main(sys.argv[1:])
    if os.environ.get("EVA_TEST_RECORD"):
        folder = Path(os.environ["EVA_TEST_RECORD"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank_{RANK}.json").write_text(json.dumps({"exit_code": code, **stopped}))
    sys.exit(code)
