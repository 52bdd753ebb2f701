"""Loss-step memory and collective traffic: our ``fastclip_v3`` loss against OpenCLIP's own ``ClipLoss``,
or (``--loss siglip``) our SigLIP loss against open_clip's own ``SigLipLoss``.

    python -m benchmarks.loss_memory [--quick] [--output runs/bench/loss_memory.json]
    python -m benchmarks.loss_memory --loss siglip --ranks 8 --sizes 4096 32768

Two contestants run side by side in the same K spawned processes (gloo process group, one thread each; K=1
in the benchmark's own process, on one thread):

- **ours**: ``build_loss("fastclip_v3", gatherer=Gatherer(rank, K), dataset_size=B)``;
- **openclip**: ``open_clip.loss.ClipLoss(local_loss=True, gather_with_grad=True, rank=r, world_size=K)``,
  OpenCLIP's own code, which calls ``torch.distributed.nn.all_gather`` itself.

With ``--loss siglip``: **ours** ``build_loss("siglip", gatherer=Gatherer(rank, K))`` against **openclip**
``open_clip.loss.SigLipLoss(rank=r, world_size=K, dist_impl="bidir")`` (its default: the texts passed to the
neighbouring ranks with autograd, their gradients sent back), with ``logit_scale = [10]`` and
``logit_bias = [-10]`` (SigLIP's init, requires_grad).

For every global batch B (b = B/K local pairs, d = 512, fp32) and each contestant, one warm-up step and
then one measured **loss step** on every rank: the loss's forward from random L2-normalised leaf features
(requires_grad) and ``logit_scale = [1/0.07]`` (requires_grad), and the backward to those leaves (not the
model). Rank 0 is reported (the ranks are symmetric; every rank's numbers go to the JSON).

- **Peak memory** (exact on CPU): ``StorageTracker`` (eva_fastclip/tensor_memory.py), a
  ``TorchDispatchMode`` that sees every op the step runs (forward, backward, collectives' output buffers),
  registers each *new* storage an op returns (not
  one of its inputs' storages: views and in-place/out= results alias those) with its nbytes, and removes
  it when the storage is deallocated (``weakref.finalize`` on the storage; PyTorch preserves a storage's
  Python object while any tensor uses it, so the finalizer runs exactly at deallocation). The peak of the
  live sum is relative to the step's start, so the inputs are excluded; the gradients it produces are
  included. At the peak it keeps the list of live storages (op, shape, Python line) to show what
  dominates. A second, independent count comes from the CPU allocator itself (``torch.profiler`` with
  ``profile_memory``: every allocation and free of c10's CPU allocator, kernel-internal scratch included).
  Not counted by either: buffers that gloo allocates in its own threads (a backend detail, not the loss's).
- **Bytes through collectives**: ``CollectiveCounter`` wraps the ``torch.distributed`` collectives for the
  step and adds, per call, the bytes this rank *sends* (its input tensors; for ``scatter``/``broadcast``
  only at the source rank), split into forward and backward. The backward is where feature gradients
  travel: OpenCLIP's gather-with-grad backward is ``_AlltoAll`` (on gloo: one ``dist.scatter`` per rank;
  on NCCL a reduce-scatter of the same input size). Ours is also checked against ``Gatherer.traffic``
  and the formula of docs/losses.md.

Then the claims are checked: ours <= OpenCLIP at every point, ours sends nothing in the backward, and the
memory slope against b·B (log-log least squares, and the ratios of the doublings of B and K).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import math
import os
import platform
import socket
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from eva_fastclip.tensor_memory import StorageTracker

GRID_K = (1, 2, 4)
GRID_B = (512, 1024, 2048, 4096)
QUICK_K = (1, 2)
QUICK_B = (256, 512)
DIM = 512
TEMPERATURE = 0.07
CONTESTANTS = ("ours", "openclip")
LOSSES = ("fastclip_v3", "siglip")
STATE_FIELDS = 2  # fastclip_v3 (RGCL-g): log_u1, log_u2
MIB = 2.0**20


@contextlib.contextmanager
def _quiet_stderr():
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class AllocatorPeak:
    """Peak of c10's CPU allocator over the block (its allocations and frees, as ``torch.profiler`` logs
    them with ``profile_memory``), relative to the start: includes kernels' internal scratch buffers."""

    def __init__(self) -> None:
        self.peak = 0
        self.end = 0

    def __enter__(self) -> AllocatorPeak:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():  # kineto logs two lines per session to fd 2, whatever KINETO_LOG_LEVEL says
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        events = [
            e for e in self._prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU
        ]  # fmt: skip
        events.sort(key=lambda e: e.start_ns())
        level = 0
        for e in events:
            level += e.nbytes()
            self.peak = max(self.peak, level)
        self.end = level


# ---- collective traffic --------------------------------------------------------------------------------


def _nbytes(x) -> int:
    if x is None:
        return 0
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)


def _first(args, kwargs, i: int, name: str):
    return args[i] if len(args) > i else kwargs.get(name)


# name -> bytes this rank sends, from the call's (args, kwargs) and this rank
_SENT = {
    "all_gather": lambda a, k, r: _nbytes(_first(a, k, 1, "tensor")),
    "all_gather_into_tensor": lambda a, k, r: _nbytes(_first(a, k, 1, "input_tensor")),
    "_all_gather_base": lambda a, k, r: _nbytes(_first(a, k, 1, "input_tensor")),
    "all_gather_object": lambda a, k, r: 0,
    "all_reduce": lambda a, k, r: _nbytes(_first(a, k, 0, "tensor")),
    "reduce": lambda a, k, r: _nbytes(_first(a, k, 0, "tensor")),
    "reduce_scatter": lambda a, k, r: _nbytes(_first(a, k, 1, "input_list")),
    "reduce_scatter_tensor": lambda a, k, r: _nbytes(_first(a, k, 1, "input")),
    "_reduce_scatter_base": lambda a, k, r: _nbytes(_first(a, k, 1, "input")),
    "all_to_all": lambda a, k, r: _nbytes(_first(a, k, 1, "input_tensor_list")),
    "all_to_all_single": lambda a, k, r: _nbytes(_first(a, k, 1, "input")),
    "scatter": lambda a, k, r: (
        _nbytes(_first(a, k, 1, "scatter_list")) if _first(a, k, 2, "src") in (r, None) else 0
    ),
    "gather": lambda a, k, r: _nbytes(_first(a, k, 0, "tensor")),
    "broadcast": lambda a, k, r: _nbytes(_first(a, k, 0, "tensor")) if _first(a, k, 1, "src") == r else 0,
    # open_clip's SigLipLoss exchanges with its neighbours: the tensors of the batch's isend ops
    "batch_isend_irecv": lambda a, k, r: sum(
        _nbytes(op.tensor) for op in _first(a, k, 0, "p2p_op_list") if op.op.__name__ == "isend"
    ),
}


class CollectiveCounter:
    """Wraps ``torch.distributed``'s collectives inside the block and counts the bytes this rank sends,
    by phase (forward/backward) and by collective; nested calls (one collective implemented by another)
    are counted once."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.phase = "forward"
        self.bytes: Counter[str] = Counter()  # phase -> bytes
        self.calls: Counter[str] = Counter()  # "phase/collective" -> bytes
        self._saved: dict[str, Any] = {}
        self._depth = 0

    def __enter__(self) -> CollectiveCounter:
        for name, sent in _SENT.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original
            setattr(dist, name, self._wrap(name, original, sent))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, name, original, sent):
        def wrapper(*args, **kwargs):
            if self._depth == 0:
                n = sent(args, kwargs, self.rank)
                self.bytes[self.phase] += n
                self.calls[f"{self.phase}/{name}"] += n
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapper


# ---- one measured loss step ----------------------------------------------------------------------------


def measure(step, rank: int, *, allocator: bool = True) -> dict[str, Any]:
    """Run ``step(set_phase)`` (forward, then ``set_phase("backward")``, then backward) under the trackers."""
    gc.collect()
    counter = CollectiveCounter(rank)
    tracker = StorageTracker()
    alloc = AllocatorPeak() if allocator else None

    def set_phase(phase: str) -> None:
        counter.phase = tracker.phase = phase

    if alloc is not None:
        alloc.__enter__()
    try:
        with counter, tracker:
            step(set_phase)
    finally:
        if alloc is not None:
            alloc.__exit__(*sys.exc_info())
    return {
        "peak_bytes": tracker.peak,
        "end_bytes": tracker.current,
        "allocated_bytes": tracker.allocated,
        "peak_phase": tracker.peak_phase,
        "allocator_peak_bytes": alloc.peak if alloc else None,
        "allocator_end_bytes": alloc.end if alloc else None,
        "bytes_forward": counter.bytes["forward"],
        "bytes_backward": counter.bytes["backward"],
        "collectives": dict(counter.calls),
        "top_at_peak": tracker.top_at_peak(),
    }


def _inputs(big_b: int, rank: int, world: int, dim: int, seed: int, loss: str = "fastclip_v3"):
    """This rank's rows of one global batch: L2-normalised leaf features, logit_scale (and SigLIP's
    logit_bias), dataset indices."""
    gen = torch.Generator().manual_seed(seed)
    e1 = F.normalize(torch.randn(big_b, dim, generator=gen), dim=-1)
    e2 = F.normalize(torch.randn(big_b, dim, generator=gen), dim=-1)
    b = big_b // world
    rows = slice(rank * b, (rank + 1) * b)
    x1 = e1[rows].clone().requires_grad_(True)
    x2 = e2[rows].clone().requires_grad_(True)
    scale = torch.tensor([1.0 / TEMPERATURE], requires_grad=True)
    indices = torch.arange(rank * b, (rank + 1) * b)
    if loss == "siglip":  # SigLIP's init: t = 10, b = -10
        return (
            x1,
            x2,
            torch.tensor([10.0], requires_grad=True),
            torch.tensor([-10.0], requires_grad=True),
            indices,
        )
    return x1, x2, scale, None, indices


def _siglip_contestant(name: str, rank: int, world: int):
    if name == "ours":
        from eva_fastclip.losses import Gatherer, build_loss

        gatherer = Gatherer(rank, world)
        loss_fn = build_loss("siglip", gatherer=gatherer)

        def forward(x1, x2, scale, bias, indices):
            return loss_fn(x1, x2, scale, indices, logit_bias=bias).loss

        return forward, (lambda: None), gatherer
    from open_clip.loss import SigLipLoss

    siglip = SigLipLoss(rank=rank, world_size=world, dist_impl="bidir")

    def forward(x1, x2, scale, bias, indices):
        return siglip(x1, x2, scale, bias)

    return forward, (lambda: None), None


def _contestant(name: str, rank: int, world: int, big_b: int, loss: str = "fastclip_v3"):
    if loss == "siglip":
        return _siglip_contestant(name, rank, world)
    if name == "ours":
        from eva_fastclip.losses import Gatherer, build_loss

        gatherer = Gatherer(rank, world)
        loss_fn = build_loss("fastclip_v3", gatherer=gatherer, dataset_size=big_b)

        def forward(x1, x2, scale, bias, indices):
            return loss_fn(x1, x2, scale, indices).loss

        def after() -> None:
            loss_fn.on_step_skipped()  # drop the staged state rows; the next step starts alike

        return forward, after, gatherer
    from open_clip.loss import ClipLoss

    clip = ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)

    def forward(x1, x2, scale, bias, indices):
        return clip(x1, x2, scale)

    return forward, (lambda: None), None


def run_point(
    rank: int,
    world: int,
    big_b: int,
    dim: int,
    warmup: int = 1,
    loss: str = "fastclip_v3",
    alone: bool = False,
) -> dict[str, Any]:
    """Both contestants at one (K, B) on this rank (``alone``: ours only): warm-up step(s), then one
    measured step each."""
    out: dict[str, Any] = {}
    for name in CONTESTANTS[:1] if alone else CONTESTANTS:
        forward, after, gatherer = _contestant(name, rank, world, big_b, loss)
        for rep in range(warmup + 1):
            x1, x2, scale, bias, indices = _inputs(big_b, rank, world, dim, seed=rep, loss=loss)
            if gatherer is not None:
                gatherer.traffic.clear()

            def step(set_phase, x1=x1, x2=x2, scale=scale, bias=bias, indices=indices, forward=forward):
                loss = forward(x1, x2, scale, bias, indices)
                set_phase("backward")
                loss.backward()

            if rep < warmup:
                step(lambda phase: None)
                after()
                continue
            result = measure(step, rank)
            after()
            grads = (x1.grad, x2.grad, scale.grad, None if bias is None else bias.grad)
            result["grad_bytes"] = sum(_nbytes(g) for g in grads if g is not None)
            result["grads_finite"] = all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
            if gatherer is not None:
                result["gatherer_traffic"] = dict(gatherer.traffic)
            out[name] = result
            del x1, x2, scale, bias, grads
            gc.collect()
    return out


def _worker(
    rank: int, world: int, port: int, sizes: list[int], dim: int, out_dir: str, loss: str, alone_above: int
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = measure_rank(rank, world, sizes, dim, loss, alone_above)
    finally:
        if world > 1:
            dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def measure_rank(
    rank: int, world: int, sizes: list[int], dim: int, loss: str = "fastclip_v3", alone_above: int = 0
) -> dict[str, Any]:
    """This rank's results at every B in ``sizes``, in a process group of ``world`` ranks already joined
    (every rank calls it); above B = ``alone_above`` (when > 0) ours alone."""
    results = {}
    for big_b in sizes:
        alone = 0 < alone_above < big_b
        results[str(big_b)] = run_point(rank, world, big_b, dim, loss=loss, alone=alone)
        if world > 1:
            dist.barrier()
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    world: int, sizes: list[int], dim: int = DIM, loss: str = "fastclip_v3", alone_above: int = 0
) -> list[dict[str, Any]]:
    """Spawn ``world`` gloo ranks that measure every B in ``sizes``; every rank's results. One rank runs in
    this process, on one thread as the spawned ones do (a new interpreter would only re-import torch)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    if world == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return [measure_rank(0, 1, list(sizes), dim, loss, alone_above)]
        finally:
            torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as out_dir:
        args = (world, _free_port(), list(sizes), dim, out_dir, loss, alone_above)
        mp.spawn(_worker, args=args, nprocs=world, join=True)
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


# ---- analysis -------------------------------------------------------------------------------------------


def expected_traffic(
    big_b: int, world: int, dim: int, s: int = 4, loss: str = "fastclip_v3"
) -> dict[str, dict[str, int]]:
    """Bytes per step and rank: docs/losses.md's formula for ours, gather-with-grad's for OpenCLIP (SigLIP:
    ours all-gathers both features; open_clip's bidir sends its texts to K-1 ranks and their gradients
    back)."""
    if world == 1:
        return {"ours": {"forward": 0, "backward": 0}, "openclip": {"forward": 0, "backward": 0}}
    b = big_b // world
    if loss == "siglip":
        ours = {"features": 2 * b * dim * s}
        exchanged = (world - 1) * b * dim * s
        return {
            "ours": {"forward": sum(ours.values()), "backward": 0, "by_purpose": ours},
            "openclip": {"forward": exchanged, "backward": exchanged},
        }
    ours = {
        "features": 2 * b * dim * s,
        "indices": 8 * b,
        "state_lookup": 4 * big_b * STATE_FIELDS,
        "state_update": b * STATE_FIELDS * s,
    }
    return {
        "ours": {"forward": sum(ours.values()), "backward": 0, "by_purpose": ours},
        "openclip": {"forward": 2 * b * dim * s, "backward": 2 * big_b * dim * s},
    }


def _fit_slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sxx if sxx else float("nan")


def analyse(points: list[dict[str, Any]], dim: int, loss: str = "fastclip_v3") -> dict[str, Any]:
    """Slopes, doubling ratios and the claims, from the rank-0 rows."""
    slopes, doubling_b, doubling_k = {}, {}, {}
    for name in CONTESTANTS:
        xs = [p["b"] * p["B"] for p in points if name in p]
        ys = [p[name]["peak_bytes"] for p in points if name in p]
        lo, hi = min(range(len(xs)), key=xs.__getitem__), max(range(len(xs)), key=xs.__getitem__)
        slopes[name] = {
            "loglog_slope": _fit_slope(xs, ys),
            "bB_ratio": xs[hi] / xs[lo],
            "peak_ratio": ys[hi] / ys[lo],
        }
        at = {(p["K"], p["B"]): p[name]["peak_bytes"] for p in points if name in p}
        doubling_b[name] = {
            f"K={k} B={bb}->{2 * bb}": at[(k, 2 * bb)] / at[(k, bb)] for (k, bb) in at if (k, 2 * bb) in at
        }
        doubling_k[name] = {
            f"B={bb} K={k}->{2 * k}": at[(2 * k, bb)] / at[(k, bb)] for (k, bb) in at if (2 * k, bb) in at
        }

    claims = {}
    both = [p for p in points if "openclip" in p]
    worse = [(p["K"], p["B"]) for p in both if p["ours"]["peak_bytes"] > p["openclip"]["peak_bytes"]]
    claims["ours_le_openclip_everywhere"] = {"holds": not worse, "violations": worse}
    bwd = [(p["K"], p["B"], p["ours"]["bytes_backward"]) for p in points if p["ours"]["bytes_backward"]]
    claims["ours_no_backward_traffic"] = {"holds": not bwd, "violations": bwd}
    formula = []
    for p in points:
        exp = expected_traffic(p["B"], p["K"], dim, loss=loss)
        for name in (n for n in CONTESTANTS if n in p):
            for phase in ("forward", "backward"):
                if p[name][f"bytes_{phase}"] != exp[name][phase]:
                    formula.append((name, p["K"], p["B"], phase, p[name][f"bytes_{phase}"], exp[name][phase]))
        if p["K"] > 1 and p["ours"].get("gatherer_traffic") != exp["ours"]["by_purpose"]:
            formula.append(("ours gatherer.traffic", p["K"], p["B"], p["ours"].get("gatherer_traffic")))
    claims["traffic_matches_formulas"] = {"holds": not formula, "violations": formula}
    # O(B²/K): memory grows no faster than b·B (log-log slope <= 1, each doubling of B at most x4 plus 10%)
    fast = [k for k, r in doubling_b["ours"].items() if r > 4 * 1.1]
    claims["ours_memory_is_O(B^2/K)"] = {
        # (one global batch per K has no slope: nothing to check)
        "holds": not slopes["ours"]["loglog_slope"] > 1.0 + 0.05 and not fast,
        "loglog_slope": slopes["ours"]["loglog_slope"],
        "violations": fast,
    }
    return {"slopes": slopes, "doubling_B": doubling_b, "doubling_K": doubling_k, "claims": claims}


# ---- the command ----------------------------------------------------------------------------------------


def run_benchmark(
    ks=GRID_K, sizes=GRID_B, dim: int = DIM, ranks=run_ranks, loss: str = "fastclip_v3"
) -> dict[str, Any]:
    """Every (K, B) point for both contestants; rank 0's rows, the analysis, and every rank's raw results.
    ``ranks(K, sizes, dim, loss)``: every rank's results (``run_ranks``, or ranks measured elsewhere)."""
    points, raw = [], {}
    for world in ks:
        usable = [big_b for big_b in sizes if big_b % world == 0]
        per_rank = ranks(world, usable, dim, loss)
        raw[str(world)] = per_rank
        for big_b in usable:
            row = per_rank[0][str(big_b)]
            points.append({"K": world, "B": big_b, "b": big_b // world, **row})
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "dim": dim,
        "loss": loss,
        "points": points,
        "analysis": analyse(points, dim, loss),
        "all_ranks": raw,
    }


def format_table(results: dict[str, Any]) -> str:
    """Peak memory and bytes sent per step on rank 0, ours beside OpenCLIP, then the claims."""
    lines = [
        f"{results.get('loss', 'fastclip_v3')} loss step, rank 0 of K, d={results['dim']}, fp32   "
        "(MiB; bytes sent per step and rank)",
        f"{'K':>2} {'B':>5} {'b':>5} | {'ours peak':>9} {'openclip':>9} {'ratio':>6} | "
        f"{'ours fwd':>10} {'ours bwd':>8} | {'oc fwd':>10} {'oc bwd':>10}",
    ]
    for p in results["points"]:
        ours, oc = p["ours"], p.get("openclip")
        theirs = (
            f"{oc['peak_bytes'] / MIB:9.2f} {ours['peak_bytes'] / oc['peak_bytes']:6.3f}"
            if oc
            else f"{'-':>9} {'-':>6}"
        )
        sent = f"{oc['bytes_forward']:>10} {oc['bytes_backward']:>10}" if oc else f"{'-':>10} {'-':>10}"
        lines.append(
            f"{p['K']:>2} {p['B']:>5} {p['b']:>5} | {ours['peak_bytes'] / MIB:9.2f} {theirs} | "
            f"{ours['bytes_forward']:>10} {ours['bytes_backward']:>8} | {sent}"
        )
    analysis = results["analysis"]
    for name, slope in analysis["slopes"].items():
        lines.append(f"{name}: log-log slope of peak memory against b·B = {slope['loglog_slope']:.3f}")
    for claim, verdict in analysis["claims"].items():
        lines.append(f"claim {claim}: {'holds' if verdict['holds'] else 'FAILS'}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.loss_memory", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help=f"K in {QUICK_K}, B in {QUICK_B} only")
    parser.add_argument("--loss", choices=LOSSES, default="fastclip_v3", help="the loss beside open_clip's")
    parser.add_argument("--ranks", type=int, nargs="+", help=f"the K of the grid (default {GRID_K})")
    parser.add_argument("--sizes", type=int, nargs="+", help=f"the global batches B (default {GRID_B})")
    parser.add_argument("--dim", type=int, default=DIM, help="embedding width")
    parser.add_argument(
        "--ours-alone-above",
        type=int,
        default=0,
        metavar="B",
        help="above this B, ours only (open_clip's memory)",
    )
    parser.add_argument("--output", default="runs/bench/loss_memory.json", help="JSON file for all results")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 where a claim about ours fails."""
    args = build_parser().parse_args(argv)
    ks, sizes = (QUICK_K, QUICK_B) if args.quick else (GRID_K, GRID_B)
    ranks = functools.partial(run_ranks, alone_above=args.ours_alone_above)
    results = run_benchmark(args.ranks or ks, args.sizes or sizes, args.dim, ranks=ranks, loss=args.loss)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2))
    print(format_table(results), flush=True)
    print(f"full results: {output}", flush=True)
    ours = [v["holds"] for k, v in results["analysis"]["claims"].items() if k.startswith("ours")]
    return 0 if all(ours) else 1


if __name__ == "__main__":
    sys.exit(main())
