"""LAMB's step on a CPU in two passes at memory speed: a compiled pass that measures, then torch's fused
AdamW kernel that moves.

With both bias corrections at 1, AdamW moves a tensor by ``w <- w (1 - lr decay) - lr m' / (sqrt(v') + eps)
= w - lr u``: LAMB's move, once the trust ratio is folded into the learning rate. So after the ratios are
known, the kernel ``torch.optim.AdamW(fused=True)`` runs (``torch._fused_adamw_``), given ``lr = step_size
* r`` per fragment and a step count at which ``beta^t`` is 0, advances the moments and moves the weights
in one pass: ``w, g, m, v`` read, ``w, m, v`` written, the clip applied as its ``grad_scale``.

The ratios need ``||u||`` first, of the moments the step will have. :func:`squared_norms` reads ``w, g, m,
v`` once and writes nothing: one ``torch.compile``'d function, which inductor makes one loop that computes
the moments, ``u`` and both sums per element. Being read-only, it can be run again another way if it
fails to compile.

Against the cache-sized sweep (optim/lamb_passes.py: its own passes write ``m, v, u``, then ``w``, a dozen
ops per chunk), ViT-B/16's 150 M fp32 parameters on 2 cores: LAMB's step 0.50 s -> 0.30 s (the norms
0.11 s, the kernel 0.10 s, the clip's norm 0.03 s, Python the rest). It runs on a CPU where a step has
:data:`MIN_ELEMENTS` or more (below, a step is dispatch-bound and the compile at a process's first step
would cost more than it saves), for fp32 and float64 weights, and not with ``eps_inside_sqrt`` (the kernel
adds eps outside the root).
"""

from __future__ import annotations

import logging

import torch

from eva_fastclip.optim.lamb_passes import Slot, pieces

log = logging.getLogger(__name__)

#: a step with fewer elements runs the sweep. At ~1.5 ns saved an element, a step of 32 M elements pays for
#: the compile at a process's first step (14 s on 2 cores, 3 s from inductor's cache) within ~300 steps;
#: toy models (the demo's) never compile
MIN_ELEMENTS = 1 << 25
#: a step count at which every beta^t is 0 in float: the kernel's bias corrections are then exactly 1
_STEP_AT_INFINITY = 2.0**60
#: below this many elements a fragment is measured eagerly: the compiled call costs more than the ops, and
#: dynamo would compile a graph of its own for a size of 1
EAGER_BELOW = 1 << 12

_compiled = None  # the compiled measuring pass, made at first use in this process
_unavailable = False  # it failed to compile here: the sweep steps instead


def unusable(slots: list[Slot], eps_inside_sqrt: bool) -> str | None:
    """Why this step cannot run here (None: it can): it needs fp32 or float64 arrays of one dtype and eps
    outside the root, and a process where it compiled."""
    if _unavailable:
        return "its measuring pass failed to compile in this process"
    if eps_inside_sqrt:
        return "eps_inside_sqrt: the fused AdamW kernel adds eps outside the root"
    dtypes = {t.dtype for slot in slots for t in (slot.w, slot.g, slot.m, slot.v)}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.float64}:
        return f"arrays of {sorted(map(str, dtypes))}: it steps fp32 or float64 alone"
    return None


def large_enough(slots: list[Slot]) -> bool:
    """Whether a step is large enough to pay for the compile (:data:`MIN_ELEMENTS`)."""
    return sum(slot.w.numel() for slot in slots) >= MIN_ELEMENTS


def give_up(error: Exception) -> None:
    """After the measuring pass failed to compile: this process steps by the sweep from now on, said once."""
    global _unavailable
    _unavailable = True
    log.warning(
        "LAMB's compiled measuring pass failed (%s: %s); this process steps LAMB by its cache-sized sweep "
        "instead, about twice as slow on a large model",
        type(error).__name__,
        (str(error).splitlines() or [""])[0],
    )


def _measure(w, g, m, v, inv_scale, one_minus_beta1, beta2, one_minus_beta2, eps, decay):
    """``||w||^2`` and ``||u||^2`` of one fragment, for the moments the step will give it (none written).
    The root is taken of ``max(v, smallest normal)``, as the sweep takes it (lamb_passes._moments_of_chunk:
    a CPU's root of 0 or a subnormal is ~8x slower; the sum is the same)."""
    g = g / inv_scale
    m = torch.lerp(m, g, one_minus_beta1)
    v = v * beta2 + g * g * one_minus_beta2
    u = m / (torch.clamp(v, min=torch.finfo(v.dtype).tiny).sqrt() + eps) + decay * w
    return (w * w).sum(), (u * u).sum()


def _measuring_pass():
    global _compiled
    if _compiled is None:
        log.info("LAMB's CPU step: compiling its measuring pass (once a process, seconds at the first step)")
        _compiled = torch.compile(_measure, dynamic=True)  # one graph per dtype, whatever the sizes
    return _compiled


class _Scalars:
    """A group's settings and the clip as 0-dim tensors of the weights' dtype (a float argument would be
    compiled into the graph: a recompile per value), made once per step and settings."""

    def __init__(self, dtype: torch.dtype, inv_scale: float) -> None:
        self.dtype = dtype
        self.inv_scale = torch.tensor(inv_scale, dtype=dtype)
        self._by_settings: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def of(self, settings: tuple[float, float, float, float]) -> tuple[torch.Tensor, ...]:
        if settings not in self._by_settings:
            beta1, beta2, eps, decay = settings
            values = (1.0 - beta1, beta2, 1.0 - beta2, eps, decay)
            self._by_settings[settings] = tuple(torch.tensor(x, dtype=self.dtype) for x in values)
        return self._by_settings[settings]


def squared_norms(slots: list[Slot], grad_scale: float | None) -> torch.Tensor:
    """The squared norms of ``w`` and ``u`` of every fragment, in slot order, as a (2, fragments) float64
    tensor, nothing written (so a failure to compile leaves the step to be taken another way).
    ``grad_scale``: the clip coefficient (None: no clip)."""
    dtype = slots[0].w.dtype
    scalars = _Scalars(dtype, _inverse_scale(grad_scale, dtype))
    sums = []
    for slot in slots:
        arrays = (slot.w, slot.g, slot.m, slot.v)
        if not all(t.is_contiguous() for t in arrays):  # channels-last: one fragment, the whole tensor
            sums.append(_measure(*arrays, scalars.inv_scale, *scalars.of(slot.settings)))
            continue
        # flat views of bases of their own (detach): dynamo guards a view on its base's shape, which would
        # compile a graph per kind of tensor (matrix, vector, conv weight)
        for views in zip(*(pieces(t.view(-1).detach(), slot.fragments) for t in arrays)):
            measure = _measure if views[0].numel() < EAGER_BELOW else _measuring_pass()
            sums.append(measure(*views, scalars.inv_scale, *scalars.of(slot.settings)))
    if not sums:
        return torch.zeros(2, 0, dtype=torch.float64)
    return torch.stack([torch.stack(pair) for pair in sums]).double().T.contiguous()


def move(slots: list[Slot], ratios: torch.Tensor, step_sizes: list[float], grad_scale: float | None) -> None:
    """Advance every fragment's moments and move its weights, ``w += step_size * r * u``, by the fused
    kernel (``ratios``, ``step_sizes``: one each, in slot order, from :func:`squared_norms`' order).
    Padding (elements outside every fragment) is left as it is: its gradient is 0 (ZeRO pads with zeros),
    so its moments stay 0 either way."""
    dtype = slots[0].w.dtype
    inv_scale = None
    if grad_scale is not None and dtype == torch.float32:
        inv_scale = torch.tensor(_inverse_scale(grad_scale, dtype), dtype=torch.float32)  # the kernel's
    elif grad_scale is not None:  # float64: the kernel's float32 scale would round the clip; scale first
        for slot in slots:
            slot.g.mul_(grad_scale)
    steps = torch.tensor(_STEP_AT_INFINITY)
    ratios_of = iter(ratios.tolist())
    sizes_of = iter(step_sizes)
    for slot in slots:
        beta1, beta2, eps, decay = slot.settings
        arrays = (slot.w, slot.g, slot.m, slot.v)
        for w, g, m, v in zip(*(pieces(t, slot.fragments) for t in arrays)):
            torch._fused_adamw_(
                [w], [g], [m], [v], [], [steps],
                lr=-next(sizes_of) * next(ratios_of),  # step_sizes are negative: -lr * bias correction
                beta1=beta1, beta2=beta2, weight_decay=decay, eps=eps,
                amsgrad=False, maximize=False, grad_scale=inv_scale,
            )  # fmt: skip


def _inverse_scale(grad_scale: float | None, dtype: torch.dtype) -> float:
    """1 / the clip coefficient as the kernel will divide by it: rounded to float32 for fp32 weights."""
    if grad_scale is None:
        return 1.0
    if dtype == torch.float32:
        return float(torch.tensor(1.0 / grad_scale, dtype=torch.float32))
    return 1.0 / grad_scale
