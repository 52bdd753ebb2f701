"""LAMB optimizer step time: trust ratio per tensor against per ZeRO partition (and FusedLamb); at ZeRO-0,
each way our LAMB walks memory against OpenCLIP's AdamW.

``--layout zero1`` (the default): the time of one LAMB optimizer step with the trust ratio per model tensor
(ours, optim/lamb.py), per flat ZeRO partition (DeepSpeed's rule, eva_fastclip's before), and DeepSpeed's
FusedLamb (per partition, its CUDA kernel) where CUDA is present.

``--layout zero0``: the model's own tensors in one call, as ZeRO-0 hands them to our optimizer: our LAMB by
each way it walks memory on this device (``Lamb.cpu_walk``: the fused CPU step, the cache-sized sweep; the
multi-tensor passes), against ``torch.optim.AdamW`` with OpenCLIP's settings and PyTorch's default
implementation (what open_clip_train steps) and fused (our AdamW).

    python -m benchmarks.lamb_step [--layout zero0] [--width 768] [--layers 12] [--rounds 7] [--device cuda]

The parameters have a ViT-B/16 vision tower's shapes (86M by default), grouped as EVA-CLIP groups them (one
group per layer and decay or not, engine/setup.py) and flattened as ZeRO-1 lays a group out on one rank:
one fp32 buffer per group, tensors back to back, padded to an even length, stepped one group per call as
DeepSpeed steps them. Every contestant steps its own
copy of the same buffers with the same gradients, and the rounds alternate the contestants, so that the
machine's drift (other jobs, turbo) reaches them alike; the report gives each one's fastest and median
step and the ratios to the per-partition step. On K ranks the per-tensor rule adds one all-reduce of
2 x (tensors) float64 values per group call (kilobytes), which one rank does not have.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from benchmarks.command_line import run_main
from eva_fastclip.optim.lamb import Fragment, Lamb
from eva_fastclip.plan.precision import cpu_model

PER_PARTITION, PER_TENSOR, FUSED = "per_zero_partition", "per_tensor", "fused_lamb"
#: ZeRO-0's contestants: our LAMB by each walk, and AdamW as open_clip_train runs it (PyTorch's default
#: implementation: foreach on CUDA, a loop over tensors on a CPU) and fused (ours)
LAMB_WALKS = {"lamb_fused_cpu": "fused", "lamb_sweep": "sweep", "lamb_multi_tensor": "multi"}
OPENCLIP_ADAMW, FUSED_ADAMW = "openclip_adamw", "adamw_fused"


def vit_tensors(width: int = 768, layers: int = 12, patch: int = 16, image: int = 224) -> list[dict]:
    """The trainable tensors of a ViT vision tower (timm / open_clip layout, MLP ratio 4) with the group
    EVA-CLIP's parameter groups put each in: ``layer`` (0: embeddings, L + 1: the head) and ``decay``."""
    tokens = (image // patch) ** 2 + 1
    tensors = [
        ("patch_embed.weight", (width, 3, patch, patch), 0, True),
        ("cls_token", (1, 1, width), 0, False),
        ("pos_embed", (1, tokens, width), 0, False),
    ]
    for i in range(layers):
        block = [
            ("norm1.weight", (width,), False),
            ("norm1.bias", (width,), False),
            ("attn.qkv.weight", (3 * width, width), True),
            ("attn.qkv.bias", (3 * width,), False),
            ("attn.proj.weight", (width, width), True),
            ("attn.proj.bias", (width,), False),
            ("norm2.weight", (width,), False),
            ("norm2.bias", (width,), False),
            ("mlp.fc1.weight", (4 * width, width), True),
            ("mlp.fc1.bias", (4 * width,), False),
            ("mlp.fc2.weight", (width, 4 * width), True),
            ("mlp.fc2.bias", (width,), False),
        ]
        tensors += [(f"blocks.{i}.{name}", shape, i + 1, decay) for name, shape, decay in block]
    tensors += [("norm.weight", (width,), layers + 1, False), ("norm.bias", (width,), layers + 1, False)]
    tensors.append(("head.weight", (512, width), layers + 1, True))
    return [{"name": n, "shape": s, "layer": layer, "decay": d} for n, s, layer, d in tensors]


def flat_groups(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat buffer per (layer, decay) group as ZeRO-1 makes it on one rank: its size and the fragment
    of every tensor in it (tensor numbers index ``tensors``)."""
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for index, tensor in enumerate(tensors):
        group = groups.setdefault((tensor["layer"], tensor["decay"]), {"fragments": [], "size": 0})
        numel = 1
        for n in tensor["shape"]:
            numel *= n
        group["fragments"].append(Fragment(index, group["size"], numel))
        group["size"] += numel
    for (_, decay), group in groups.items():
        group["size"] += group["size"] % 2  # DeepSpeed aligns each flat group to an even length
        group["weight_decay"] = 0.05 if decay else 0.0
    return list(groups.values())


def run_lamb_benchmark(
    width: int = 768,
    layers: int = 12,
    rounds: int = 5,
    device: str | None = None,
    output: str | Path | None = None,
    layout: str = "zero1",
) -> dict[str, Any]:
    """Time ``rounds`` steps of every contestant (after one untimed step each) and write the results."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tensors = vit_tensors(width, layers)
    g = torch.Generator().manual_seed(0)
    if layout == "zero0":
        shapes = [t["shape"] for t in tensors]
        weights = [torch.randn(s, generator=g).mul_(0.02).to(device) for s in shapes]
        grads = [torch.randn(s, generator=g).mul_(1e-3).to(device) for s in shapes]
        names = _zero0_names(device)
        contestants = {name: _zero0_contestant(name, weights, grads, tensors) for name in names}
        baseline_name, groups, what = OPENCLIP_ADAMW, [], "one optimizer step over a ViT's tensors (ZeRO-0)"
    else:
        groups = flat_groups(tensors)
        weights = [torch.randn(group["size"], generator=g).mul_(0.02).to(device) for group in groups]
        grads = [torch.randn(group["size"], generator=g).mul_(1e-3).to(device) for group in groups]
        names = [PER_PARTITION, PER_TENSOR] + ([FUSED] if device.type == "cuda" else [])
        contestants = {name: _contestant(name, weights, grads, groups, len(tensors)) for name in names}
        baseline_name, what = (
            PER_PARTITION,
            "one LAMB optimizer step over a ViT's flat ZeRO-1 groups on one rank",
        )
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds + 1):
        for name in names if round_ % 2 == 0 else reversed(names):
            seconds = _timed_step(contestants[name], device, per_group=layout != "zero0")
            if round_ > 0:  # the first step allocates the moments (and compiles the fused CPU step)
                times[name].append(seconds)
    baseline = min(times[baseline_name])
    results = {
        "what": what,
        "layout": layout,
        "baseline": baseline_name,
        "params": sum(w.numel() for w in weights),
        "tensors": len(tensors),
        "groups": len(groups),
        "width": width,
        "layers": layers,
        "rounds": rounds,
        "device": _device_name(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": date.today().isoformat(),
        "contestants": {
            name: {
                "step_times_s": times[name],
                "fastest_s": min(times[name]),
                "median_s": statistics.median(times[name]),
                "fastest_vs_baseline": min(times[name]) / baseline,
            }
            for name in names
        },
    }
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(results, indent=2))
        results["output"] = str(output)
    return results


def format_lamb_report(results: dict[str, Any]) -> str:
    lines = [
        f"{results['what']}: {results['params'] / 1e6:.1f}M parameters, {results['tensors']} tensors, "
        f"{results['groups']} groups; {results['device']}, {results['threads']} threads, torch "
        f"{results['torch']}, {results['date']}",
        f"{'contestant':<20} {'fastest s':>10} {'median s':>10} {'fastest / ' + results['baseline']:>30}",
    ]
    for name, r in results["contestants"].items():
        ratio = r["fastest_vs_baseline"]
        lines.append(f"{name:<20} {r['fastest_s']:>10.4f} {r['median_s']:>10.4f} {ratio:>30.3f}")
    return "\n".join(lines)


def _contestant(name, weights, grads, groups, num_tensors) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for param, grad in zip(params, grads):
        param.grad = grad  # shared by every contestant: read only
    settings = [{"params": [p], "weight_decay": group["weight_decay"]} for p, group in zip(params, groups)]
    if name == FUSED:
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb(settings, lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    optimizer = Lamb(settings, lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    if name == PER_TENSOR:
        optimizer.set_fragments([(p, group["fragments"]) for p, group in zip(params, groups)], num_tensors)
    return optimizer


def _zero0_names(device: torch.device) -> list[str]:
    walks = ["lamb_multi_tensor"] if device.type == "cuda" else ["lamb_fused_cpu", "lamb_sweep"]
    return [*walks, OPENCLIP_ADAMW, FUSED_ADAMW]


def _zero0_contestant(name, weights, grads, tensors) -> torch.optim.Optimizer:
    """One optimizer over copies of the model's tensors, decayed as OpenCLIP decays them (matrices)."""
    from benchmarks.step_contestants import OPENCLIP_BETAS, OPENCLIP_EPS, OPENCLIP_LR, OPENCLIP_WD

    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for param, grad in zip(params, grads):
        param.grad = grad  # shared by every contestant: read only
    decayed = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": OPENCLIP_WD},
               {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
    settings = dict(lr=OPENCLIP_LR, betas=OPENCLIP_BETAS, eps=OPENCLIP_EPS)
    if name in LAMB_WALKS:
        optimizer = Lamb(decayed, **settings)
        optimizer.cpu_walk = LAMB_WALKS[name]
        return optimizer
    return torch.optim.AdamW(decayed, fused=name == FUSED_ADAMW or None, **settings)


def _timed_step(optimizer: torch.optim.Optimizer, device: torch.device, per_group: bool = True) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    if not per_group:  # ZeRO-0: the model's tensors in one call
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start
    groups = optimizer.param_groups
    try:  # one call per group, as DeepSpeed's ZeRO-1/2 step their inner optimizer
        for group in groups:
            optimizer.param_groups = [group]
            optimizer.step()
    finally:
        optimizer.param_groups = groups
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lamb_step", description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=("zero1", "zero0"), default="zero1",
                   help="zero1: flat groups, per tensor against per partition; zero0: the model's tensors, "
                   "our LAMB's walks against OpenCLIP's AdamW")  # fmt: skip
    p.add_argument("--width", type=int, default=768, help="ViT width of the parameter set (ViT-B/16: 768)")
    p.add_argument("--layers", type=int, default=12, help="ViT blocks of the parameter set")
    p.add_argument("--rounds", type=int, default=7, help="timed steps of each contestant, alternating")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where present)")
    p.add_argument("--output", default="runs/bench/lamb_step.json", help="JSON file for all step times")
    return p


def main(argv: list[str] | None = None) -> int:
    def run(args) -> int:
        results = run_lamb_benchmark(
            width=args.width,
            layers=args.layers,
            rounds=args.rounds,
            device=args.device,
            output=args.output,
            layout=args.layout,
        )
        print(format_lamb_report(results), flush=True)
        print(f"full results: {results['output']}", flush=True)
        return 0

    return run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
