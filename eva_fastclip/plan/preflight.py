"""Every check a run can make before step 1: what it will read, where it will write, and whether its lengths
make sense.

A wrong path otherwise surfaces when it is first used: ``eval.zeroshot_dir`` after the last step and the
final save, days into a run; a Hugging Face tokenizer missing from a text folder never (transformers then
builds one with an empty vocabulary from config.json alone). :func:`check_inputs` looks at every input the
config names (training shards, evaluation folders and shards, weight files, the architecture and its
tokenizer) and at the output folder (an earlier run's checkpoints there need ``--resume``);
:func:`check_schedule` at lengths that leave a run without meaning (a batch larger than an epoch,
accumulation that leaves an epoch without an optimizer step, a warm-up longer than the run). They create,
download and start nothing, and return every problem at once, each naming its config key and the fix.

The run plan (plan/run_plan.py) runs them with the data's sizes and the resume checkpoint's keys;
``eva-fastclip train`` checks the paths on every rank before the process group starts (``--dry-run`` prints
the plan).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eva_fastclip.config import ConfigError, ExperimentConfig
from eva_fastclip.data import DataSizes, expand_urls, resolve_sizes
from eva_fastclip.data.remote import is_remote
from eva_fastclip.evaluation.sets import read_classification_folder
from eva_fastclip.plan.layout import BatchLayout

log = logging.getLogger(__name__)

#: files that hold a Hugging Face tokenizer's vocabulary, one of which a text folder needs: tokenizer.json
#: (fast tokenizers), vocab.txt (WordPiece), vocab.json (with merges.txt: BPE) or a sentencepiece model
HF_VOCAB_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "*.model", "*.spm")
#: files that hold a Hugging Face model's weights
HF_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


@dataclass(frozen=True, slots=True)
class Problem:
    key: str
    """The config key (or command-line option) to change."""
    message: str
    """What is wrong and what to change."""
    error: bool = True
    """False: a warning; the run can start."""

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


class PreflightError(ConfigError):
    """The run cannot start; the message lists every error found.

    Rank 0's verdict reaches the other ranks pickled (reliability/process.py's ``on_rank0``): pickle
    rebuilds an exception from ``args``, so ``__reduce__`` gives back the list, not the message (which
    would come back as one "problem" per character)."""

    def __init__(self, errors: list[Problem]) -> None:
        self.errors = list(errors)
        super().__init__(
            f"{len(errors)} problem(s) before step 1:\n" + "\n".join(f"  - {problem}" for problem in errors)
        )

    def __reduce__(self):
        return type(self), (self.errors,)


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    sizes: DataSizes | None = None
    """Samples per epoch and per-sample table rows, when the training shards were read."""
    total_steps: int | None = None
    """Optimizer steps of the whole run, when the data's size is known."""

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.error]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if not p.error]

    def to_dict(self) -> dict[str, Any]:
        return {
            "errors": [str(p) for p in self.errors],
            "warnings": [str(p) for p in self.warnings],
            "total_steps": self.total_steps,
        }


def raise_for_errors(problems: Iterable[Problem], *, log_warnings: bool = True) -> None:
    """Log the warnings (where ``log_warnings``) and raise :class:`PreflightError` listing the errors."""
    problems = list(problems)
    if log_warnings:
        for problem in problems:
            if not problem.error:
                log.warning("%s", problem)
    errors = [p for p in problems if p.error]
    if errors:
        raise PreflightError(errors)


def check_inputs(
    cfg: ExperimentConfig, *, resume: str | None = None, train_shards: bool = True
) -> list[Problem]:
    """Every path the run reads or writes: the model's files, the image decode, the evaluation sets, the
    output folder and an earlier run's checkpoints in it (or the ``--resume`` checkpoint), and (unless
    ``train_shards`` is False: a loader given to the Trainer) the training shards. Files only: the
    lengths are checked once the data's sizes are known (:func:`check_schedule`)."""
    problems = check_model(cfg) + check_image_decode(cfg) + check_compile(cfg) + check_eval(cfg)
    problems += check_output_dir(cfg.train.output_dir)
    if resume is None:
        problems += check_earlier_run(cfg.train.output_dir, cfg.train.remote_dir)
    if train_shards:
        problems += check_train_shards(cfg)[1]
    return problems


# ---- lengths ---------------------------------------------------------------------------------------


def total_steps(cfg: ExperimentConfig, layout: BatchLayout, micro_batches_per_epoch: int) -> int:
    """Optimizer steps of the run: ``train.steps``, else ``train.epochs`` epochs of whole steps."""
    return cfg.train.steps or cfg.train.epochs * (micro_batches_per_epoch // layout.grad_accum_steps)


def check_schedule(
    cfg: ExperimentConfig,
    layout: BatchLayout,
    micro_batches_per_epoch: int,
    *,
    num_samples: int | None = None,
) -> list[Problem]:
    """Lengths that leave the run without meaning, from the micro-batches each rank draws per epoch."""
    train, world_size = cfg.train, layout.world_size
    micro, accum = layout.micro_batch, layout.grad_accum_steps
    by_global = train.global_batch is not None  # then the batch keys are derived: name what the user sets
    if micro_batches_per_epoch < 1:
        held = f"an epoch of {num_samples} samples" if num_samples is not None else "an epoch"
        fix = "lower train.global_batch" if by_global else "lower train.batch_size"
        return [
            Problem(
                "train.global_batch" if by_global else "train.batch_size",
                f"{held} does not fill one batch of {micro} on each of {world_size} rank(s) "
                f"({layout.samples_per_forward} samples; {layout.source}): {fix} or use more data "
                "(data.num_samples, data.train_shards)",
            )
        ]
    if micro_batches_per_epoch < accum:
        fix = (
            "lower train.global_batch or raise train.max_micro_batch"
            if by_global
            else f"lower train.grad_accum_steps to at most {micro_batches_per_epoch} or train.batch_size"
        )
        return [
            Problem(
                "train.global_batch" if by_global else "train.grad_accum_steps",
                f"one epoch has {micro_batches_per_epoch} micro-batches per rank, fewer than the "
                f"{accum} accumulated per optimizer step ({layout.source}), so it holds no optimizer step: "
                f"{fix}",
            )
        ]
    pairs = layout.contrastive_batch
    if pairs < 2:
        # one pair has no negatives: OpenCLIP's loss is 0, the global contrastive loss is undefined
        key = "train.max_micro_batch" if by_global else "train.batch_size"
        return [
            Problem(
                key,
                f"each loss evaluation sees a micro-batch of {micro} x {world_size} rank(s) = {pairs} pair "
                f"({layout.source}), and a contrastive loss needs at least 2 (each anchor's negatives are "
                f"the other pairs): raise {key}, or set train.contrastive_batch=global (every pair of the "
                "step)",
            )
        ]
    problems = []
    steps = total_steps(cfg, layout, micro_batches_per_epoch)
    length = f"train.steps={train.steps}" if train.steps else f"train.epochs={train.epochs}: {steps} steps"
    warmup = cfg.optim.warmup_steps
    if warmup >= steps:
        problems.append(
            Problem(
                "optim.warmup_steps",
                f"optim.warmup_steps={warmup} is not shorter than the run ({length}): the lr never reaches "
                f"optim.lr and never decays; lower it (e.g. to {max(1, steps // 10)}) or lengthen the run",
                error=False,
            )
        )
    unmasked = cfg.model.unmasked_final_steps
    if unmasked and cfg.model.patch_dropout > 0 and unmasked >= steps:
        problems.append(
            Problem(
                "model.unmasked_final_steps",
                f"model.unmasked_final_steps={unmasked} covers the whole run ({length}): no step trains "
                "with patch dropout; lower it or set model.patch_dropout=0",
                error=False,
            )
        )
    return problems


# ---- what the run reads ----------------------------------------------------------------------------


def check_train_shards(cfg: ExperimentConfig) -> tuple[list[str] | None, list[Problem]]:
    """The training shards' URLs (None when a source fails) and the problems found."""
    urls: list[str] = []
    problems = []
    for i, source in enumerate(cfg.data.train_shards):
        key = f"data.train_shards[{i}]" if len(cfg.data.train_shards) > 1 else "data.train_shards"
        try:
            found = expand_urls(source)
        except FileNotFoundError as err:
            problems.append(Problem(key, f"{err}; point it at existing shards (a brace pattern or a folder)"))
            continue
        problems += _unreadable(key, found)
        urls += found
    return (None if problems else urls), problems


def check_image_decode(cfg: ExperimentConfig) -> list[Problem]:
    """data.image_decode=gpu decodes with nvjpeg: it needs a CUDA GPU on every rank."""
    if cfg.data.image_decode != "gpu" or torch.cuda.is_available():
        return []
    return [
        Problem(
            "data.image_decode",
            "data.image_decode=gpu decodes the training JPEGs with nvjpeg on a CUDA GPU, and this machine "
            "has none (torch.cuda.is_available() is False): set data.image_decode=workers",
        )
    ]


def check_compile(cfg: ExperimentConfig) -> list[Problem]:
    """train.compile needs torch.compile on this Python, and on a CPU a C++ compiler (engine/compiled.py);
    a tower that fails to compile at its first call stops the run there instead."""
    if not cfg.train.compile:
        return []
    from eva_fastclip.engine.compiled import compile_problem

    problem = compile_problem(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if problem is None:
        return []
    return [Problem("train.compile", f"{problem}: set train.compile=false to train the towers eagerly")]


def check_eval(cfg: ExperimentConfig) -> list[Problem]:
    problems = []
    if cfg.eval.zeroshot_dir:
        try:
            shards, _, _ = read_classification_folder(cfg.eval.zeroshot_dir)
        except (FileNotFoundError, ValueError) as err:
            problems.append(
                Problem("eval.zeroshot_dir", f"{err}; fix the folder or set eval.zeroshot_dir=null")
            )
        else:
            problems += _unreadable("eval.zeroshot_dir", shards)
    if cfg.eval.imagenet_val:
        from eva_fastclip.evaluation import read_imagenet_folder

        try:
            read_imagenet_folder(cfg.eval.imagenet_val)
        except (FileNotFoundError, ValueError) as err:
            problems.append(
                Problem("eval.imagenet_val", f"{err}; fix the folder or set eval.imagenet_val=null")
            )
    for i, source in enumerate(cfg.eval.retrieval_shards or []):
        key = "eval.retrieval_shards" + (f"[{i}]" if len(cfg.eval.retrieval_shards) > 1 else "")
        try:
            problems += _unreadable(key, expand_urls(source))
        except FileNotFoundError as err:
            problems.append(Problem(key, f"{err}; fix the path or set eval.retrieval_shards=null"))
    return problems


def check_model(cfg: ExperimentConfig) -> list[Problem]:
    """The architecture name, the weight files and the tokenizer: all from local files."""
    import open_clip

    import eva_fastclip.models  # noqa: F401  (registers the shipped architectures with open_clip)

    model = cfg.model
    problems = []
    for key in ("pretrained", "vision_checkpoint", "text_checkpoint"):
        path = getattr(model, key)
        if path is not None and not os.access(path, os.R_OK):
            problems.append(Problem(f"model.{key}", f"{path} cannot be read (permissions)"))
    arch = open_clip.get_model_config(model.name) if model.name in open_clip.list_models() else None
    if arch is None:
        close = difflib.get_close_matches(model.name, open_clip.list_models(), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "open_clip.list_models() lists them"
        problems.append(
            Problem(
                "model.name",
                f"{model.name!r} is not an open_clip architecture nor one in eva_fastclip/models/configs "
                f"({hint})",
            )
        )
    if model.text_hf_model is not None:
        problems += _check_hf_folder(model.text_hf_model, weights=model.pretrained is None)
    elif arch is not None:
        text_cfg = arch.get("text_cfg", {})
        for name_key, what, files in (
            ("hf_model_name", "text model", ("config.json",)),
            ("hf_tokenizer_name", "tokenizer", ("tokenizer_config.json", "tokenizer.json")),
        ):
            name = text_cfg.get(name_key)
            if name and not _hf_local(name, files):
                problems.append(
                    Problem(
                        "model.name",
                        f"{model.name} takes its {what} from the Hugging Face model {name!r}, which is "
                        "neither a local folder nor in the local Hugging Face cache, and eva_fastclip never "
                        "downloads: set model.text_hf_model to a local folder holding it",
                    )
                )
    return problems


def _check_hf_folder(folder: str, *, weights: bool) -> list[Problem]:
    path = Path(folder)
    problems = []
    if not _any_file(path, HF_VOCAB_FILES):
        problems.append(
            Problem(
                "model.text_hf_model",
                f"{folder} holds no tokenizer (none of {', '.join(HF_VOCAB_FILES)}); transformers would "
                "build one with an empty vocabulary from config.json: save the tokenizer into the folder "
                "(tokenizer.save_pretrained(folder))",
            )
        )
    if weights and not _any_file(path, HF_WEIGHT_FILES):
        problems.append(
            Problem(
                "model.text_hf_model",
                f"{folder} holds no weights (none of {', '.join(HF_WEIGHT_FILES)}): save the model into the "
                "folder (model.save_pretrained(folder)), or give model.pretrained a checkpoint that holds "
                "the text tower",
            )
        )
    return problems


def _any_file(folder: Path, patterns: tuple[str, ...]) -> bool:
    return any(path.is_file() for pattern in patterns for path in folder.glob(pattern))


def _hf_local(name: str, files: tuple[str, ...]) -> bool:
    """Whether a Hugging Face name (a folder or a hub id) can be read without a download."""
    if Path(name).is_dir():
        return any((Path(name) / f).is_file() for f in files)
    from huggingface_hub import try_to_load_from_cache

    for filename in files:
        try:
            if isinstance(try_to_load_from_cache(name, filename), str):
                return True
        except ValueError:  # not a valid hub id either
            return False
    return False


def check_earlier_run(output_dir: str, remote_dir: str | None = None) -> list[Problem]:
    """A run without ``--resume`` in a folder (or a train.remote_dir) that holds complete checkpoints would
    start over its step log and let retention delete the earlier run's checkpoints: it does not start, and
    touches nothing."""
    from eva_fastclip.checkpointing.checkpoint import complete_checkpoints

    root = Path(output_dir) / "checkpoints"
    try:
        found = complete_checkpoints(root)
    except OSError:  # unreadable: check_output_dir names it
        return []
    if not found and remote_dir:
        return _earlier_remote_run(remote_dir)
    if not found:
        return []
    return [
        Problem(
            "--resume",
            f"train.output_dir={output_dir} holds complete checkpoints of an earlier run (the latest: "
            f"{found[-1]}); a run that starts over there would cut its train_log.jsonl and delete them "
            f"(train.keep_checkpoints). Continue it with --resume latest; to start over, choose another "
            f"train.output_dir or delete {root} first",
        )
    ]


def _earlier_remote_run(remote_dir: str) -> list[Problem]:
    from eva_fastclip.checkpointing.remote_copy import remote_checkpoints
    from eva_fastclip.data.remote import url_fs

    try:
        fs, root = url_fs(remote_dir.rstrip("/"))
        found = remote_checkpoints(fs, root)
    except Exception as err:  # noqa: BLE001 (every client's own errors: named, as a problem)
        return [Problem("train.remote_dir", f"{remote_dir} cannot be listed ({type(err).__name__}: {err})")]
    if not found:
        return []
    return [
        Problem(
            "--resume",
            f"train.remote_dir={remote_dir} holds complete checkpoints of an earlier run (the latest: "
            f"{found[-1]}): one run per folder, there as in train.output_dir. Continue it with --resume "
            "latest (a fresh node brings the latest down); to start over, choose another train.remote_dir",
        )
    ]


def _unreadable(key: str, urls: list[str]) -> list[Problem]:
    local = [url for url in urls if not is_remote(url) and not url.startswith("pipe:")]
    denied = [url for url in local if not os.access(url, os.R_OK)]
    if denied:
        return [
            Problem(
                key, f"{len(denied)} of {len(urls)} shards cannot be read (permissions; first: {denied[0]})"
            )
        ]
    return []


# ---- what the run writes ---------------------------------------------------------------------------


def check_output_dir(output_dir: str) -> list[Problem]:
    """The output folder, or the nearest folder above it that exists, is a folder this process may write
    in; so are the run's own subfolders where they exist already."""
    path = Path(output_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return [
            Problem(
                "train.output_dir", f"{existing} is a file, not a folder: choose another train.output_dir"
            )
        ]
    candidates = [existing] + [path / sub for sub in ("checkpoints", "tensorboard") if (path / sub).is_dir()]
    for folder in candidates:
        if not os.access(folder, os.W_OK | os.X_OK):
            return [
                Problem(
                    "train.output_dir",
                    f"cannot write in {folder} (permissions or a read-only filesystem): choose another "
                    "train.output_dir or fix its permissions",
                )
            ]
    return []


def needs_index(cfg: ExperimentConfig) -> bool:
    """Whether the loss keeps per-sample state, and so needs every sample's dataset index."""
    from eva_fastclip.losses import LOSSES, CompositionalLoss

    return issubclass(LOSSES[cfg.loss.name], CompositionalLoss)


def train_data(cfg: ExperimentConfig) -> tuple[list[str] | None, DataSizes | None, list[Problem]]:
    """The training shards checked and their sizes read: (URLs, sizes, problems); None where they could
    not be read (the problems say why)."""
    urls, problems = check_train_shards(cfg)
    if urls is None:
        return None, None, problems
    try:
        return urls, data_sizes(cfg, urls), problems
    except ValueError as err:
        key = next((k for k in ("data.num_samples", "data.index_size") if k in str(err)), "data.train_shards")
        return urls, None, [*problems, Problem(key, str(err))]


def data_sizes(cfg: ExperimentConfig, urls: list[str] | None = None) -> DataSizes:
    """The training data's sizes: the config's numbers, the others read from the records of the shards
    (``urls``, else those of data.train_shards). ValueError naming the key to set where none is."""
    if urls is None:
        urls = [url for source in cfg.data.train_shards for url in expand_urls(source)]
    return resolve_sizes(
        urls,
        num_samples=cfg.data.num_samples,
        index_size=cfg.data.index_size,
        needs_index=needs_index(cfg),
        index_key=cfg.data.index_key,
    )


def sizes_dict(report: Report) -> dict[str, Any]:
    """The dry-run's "data" entry: the sizes and where they come from, or why they were not read."""
    if report.sizes is not None:
        sizes = asdict(report.sizes)
        counted = sizes.pop("shard_counts") is not None
        # how the loader splits an epoch between its consumers (data.md: every sample once)
        sizes["epoch_split"] = "samples" if counted else "whole shards (counts unknown)"
        return sizes
    why = [str(p) for p in report.problems if p.key.startswith("data.")]
    return {"not_checked": "; ".join(why) or "the training shards were not read"}
