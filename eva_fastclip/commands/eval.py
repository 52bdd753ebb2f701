"""``eva-fastclip eval``: zero-shot evaluation of a checkpoint or an exported model; under a launcher every
rank evaluates its share."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from eva_fastclip.commands.common import add_config_args
from eva_fastclip.config import load_config

HELP = (
    "zero-shot evaluation of a checkpoint folder or an exported model: the eval.* sets, or a suite "
    "(under a launcher, every rank evaluates its share)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument(
        "--checkpoint", required=True, help="checkpoint folder (step_XXXXXXXX), exported .pt file or folder"
    )
    p.add_argument(
        "--suite",
        choices=["datacomp"],
        default=None,
        help="datacomp: DataComp's 38 tasks (FastCLIP's benchmark), those whose clip_benchmark folders exist "
        "under --datasets-root (default: the eval.* sets of the config)",
    )
    p.add_argument(
        "--datasets-root",
        default=None,
        help="with --suite: the folder DataComp's download_evalsets.py fills (wds_* folders, hf_cache)",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "datacomp"],
        default="fp32",
        help="with --suite: fp32 throughout, or datacomp: fp16 autocast where DataComp uses it on a GPU "
        "(classifier prompts, retrieval, WinoGAViL), which reproduces its published numbers (default fp32)",
    )
    p.add_argument(
        "--output",
        default=None,
        help="JSON file for the results (default with --suite: CHECKPOINT.SUITE.json)",
    )


def run(args) -> int:
    from eva_fastclip.engine.evaluate import evaluate_model, format_results
    from eva_fastclip.evaluation import evaluate_datacomp, format_datacomp
    from eva_fastclip.losses import Gatherer

    if args.suite and not args.datasets_root:
        raise ValueError(
            f"--suite {args.suite} needs --datasets-root DIR (a folder of clip_benchmark wds_* folders)"
        )
    if args.precision != "fp32" and not args.suite:
        raise ValueError("--precision applies to --suite; the eval.* sets run in eval.precision")
    cfg = load_config(args.config, args.overrides)
    path = Path(args.checkpoint)
    bundle, precision = load_for_evaluation(cfg, path)
    device = join_eval_ranks()
    model, collectives = bundle.model.to(device), Gatherer.from_process_group()
    is_main = collectives.rank == 0
    if args.suite == "datacomp":
        results = evaluate_datacomp(
            model,
            tokenize=bundle.tokenizer,
            preprocess=bundle.preprocess_eval,
            datasets_root=args.datasets_root,
            batch_size=cfg.eval.batch_size,
            device=device,
            precision=args.precision,
            workers=cfg.eval.workers,
            collectives=collectives,
            progress=is_main,
        )
        text, output = format_datacomp(results), args.output or f"{path}.{args.suite}.json"
    else:
        results = evaluate_model(
            model,
            bundle,
            cfg.eval,
            device=device,
            dtype=precision.dtype,
            collectives=collectives,
            progress=is_main,
            caption_key=cfg.data.caption_keys[0],
        )
        text, output = format_results(results, precision), args.output
    if is_main:
        print(text)
        if output:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            Path(output).write_text(json.dumps({"checkpoint": str(path), **results}, indent=2))
            print(f"results: {output}")
    return 0


def load_for_evaluation(cfg, path: Path):
    """The model of ``cfg`` with the weights of ``path`` (a checkpoint folder, an exported ``.pt`` file or
    open_clip folder), held as its run held them to evaluate in ``eval.precision``
    (engine/evaluate.py); returns (bundle, EvalPrecision)."""
    import torch
    from open_clip.constants import HF_SAFE_WEIGHTS_NAME

    from eva_fastclip.engine.evaluate import EvalPrecision, hold_as_trained
    from eva_fastclip.export import consolidated_state_dict, trained_as
    from eva_fastclip.models import SCALAR_PARAMETERS, create_model

    bundle = create_model(cfg.model, logit_bias_init=cfg.loss.logit_bias_init)  # a trained SigLIP's bias
    trained, saved_dtype = None, torch.float32  # an export records neither
    if (path / HF_SAFE_WEIGHTS_NAME).is_file():  # an exported open_clip folder
        import safetensors.torch

        state_dict = safetensors.torch.load_file(path / HF_SAFE_WEIGHTS_NAME)
    elif path.is_dir():
        state_dict = consolidated_state_dict(path)
        trained, saved_dtype = trained_as(path)
    else:
        state_dict = torch.load(path, map_location="cpu")
    for name in SCALAR_PARAMETERS:  # open_clip's 0-dim, ours [1]
        if name in state_dict and getattr(bundle.model, name, None) is not None:
            state_dict[name] = state_dict[name].reshape(getattr(bundle.model, name).shape)
    bundle.model.load_state_dict(state_dict, strict=True)
    precision = EvalPrecision.choose(cfg.eval.precision, trained, f"checkpoint {path.name}")
    hold_as_trained(bundle.model, precision, saved_dtype)  # as its run held it: the same figures
    return bundle, precision


def join_eval_ranks():
    """Under a launcher (WORLD_SIZE > 1) join the process group, so each rank evaluates its share; the
    device: this rank's GPU, else the CPU."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device(f"cuda:{local_rank}" if cuda else "cpu")
