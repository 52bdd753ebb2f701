"""The passes of one LAMB step over all its tensors, as each kind of device runs them fastest.

A step (optim/lamb.py) needs, per parameter, the moments and ``u = m / (sqrt(v) + eps) + decay * w``; per
fragment of a model tensor (the whole tensor without ZeRO), the squared norms of its ``w`` and ``u``; and
after the trust ratios are known, ``w += -step_size * r * u`` per fragment. Elementwise, the two ways below
compute the same values; they differ in how they walk memory:

- **multi-tensor** (CUDA): one launch per op for all tensors (``torch._foreach_*``): the moments in 6
  passes, both norms of every fragment in one ``_foreach_norm``, the update in one ``_foreach_addcmul_``
  whose per-fragment ratios stay on the device. Nothing waits for the device.
- **cache-sized sweep** (CPU): an op is a loop over memory anyway, and a pass per op over tensors larger
  than the caches reads and writes every array once per op. Here each parameter is cut at its fragments'
  edges and into chunks of :data:`CPU_CHUNK` elements; each chunk runs all of its ops (the clip, the
  moments, ``u``, the squared norms as dot products) while its arrays are in the cache, so the sweep reads
  ``g, m, v, w`` and writes ``m, v, u`` once. The update is one pass more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

#: elements of one CPU chunk: its five arrays (w, g, m, v, u) stay in the cache while all its ops run
CPU_CHUNK = 1 << 18


class Fragment(NamedTuple):
    """Elements ``start .. start + length`` of a flat parameter belong to model tensor ``tensor``."""

    tensor: int
    start: int
    length: int


class Slot(NamedTuple):
    """One parameter's arrays for a step (flat views), its fragments and its group's settings."""

    w: torch.Tensor
    g: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    fragments: Sequence[Fragment]
    settings: tuple[float, float, float, float]  # beta1, beta2, eps, weight decay


def pieces(tensor: torch.Tensor, frags: Sequence[Fragment]) -> list[torch.Tensor]:
    """The fragments' views of ``tensor`` (the tensor itself where one fragment is all of it)."""
    if len(frags) == 1 and frags[0].start == 0 and frags[0].length == tensor.numel():
        return [tensor]
    flat = tensor.view(-1)
    return [flat.narrow(0, f.start, f.length) for f in frags]


def sweep_cpu(
    slots: list[Slot], eps_inside_sqrt: bool, grad_scale: float | None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The cache-sized sweep: every slot's moments advanced and its ``u`` (returned), and the squared
    norms of ``w`` and ``u`` of every fragment, in slot order, as a (2, fragments) float64 tensor.
    ``grad_scale``: the clip coefficient, applied to each gradient chunk first (None: no clip)."""
    updates, sums = [], []
    for slot in slots:
        u = torch.empty_like(slot.w)
        updates.append(u)
        if not all(t.is_contiguous() for t in (slot.w, slot.g, slot.m, slot.v)):  # (channels-last weights)
            if grad_scale is not None:
                slot.g.mul_(grad_scale)
            _moments_of_chunk(slot.w, slot.g, slot.m, slot.v, u, *slot.settings, eps_inside_sqrt)
            # one fragment: a whole tensor (ZeRO's flat partitions are contiguous)
            sums.append(tuple(_squared_norm(t) for t in (slot.w, u)))
            continue
        arrays = (slot.w.view(-1), slot.g.view(-1), slot.m.view(-1), slot.v.view(-1), u.view(-1))
        for start, length, measured in _segments(slot.w.numel(), slot.fragments):
            weight_sq = update_sq = 0.0
            for chunk in zip(*(array.narrow(0, start, length).split(CPU_CHUNK) for array in arrays)):
                if grad_scale is not None:
                    chunk[1].mul_(grad_scale)
                _moments_of_chunk(*chunk, *slot.settings, eps_inside_sqrt)
                if measured:
                    weight_sq += torch.dot(chunk[0], chunk[0]).item()
                    update_sq += torch.dot(chunk[4], chunk[4]).item()
            if measured:
                sums.append((weight_sq, update_sq))
    return updates, torch.tensor(sums, dtype=torch.float64).reshape(-1, 2).T


def _squared_norm(tensor: torch.Tensor) -> float:
    return torch.linalg.vector_norm(tensor, dtype=torch.float64).square().item()


def _segments(numel: int, frags: Sequence[Fragment]) -> list[tuple[int, int, bool]]:
    """(start, length, is a fragment) covering ``numel`` elements: the fragments and the padding around
    them (whose moments advance too, as the kernel's do, but which no norm counts)."""
    segments, at = [], 0
    for frag in frags:
        if frag.start > at:
            segments.append((at, frag.start - at, False))
        segments.append((frag.start, frag.length, True))
        at = frag.start + frag.length
    if at < numel:
        segments.append((at, numel - at, False))
    return segments


def _moments_of_chunk(w, g, m, v, u, beta1, beta2, eps, decay, eps_inside_sqrt) -> None:
    """One chunk's moments in place and ``u`` written into ``u``: m / (sqrt(v) + eps) + decay * w.

    A CPU's square root of 0 or of a subnormal number takes ~8x its time on a normal one (measured on
    AVX-512), and ``v`` is 0 wherever a tensor's gradient is (the token embedding's rows that no sample
    of the batch uses: most of them) and decays into subnormals where it stays so. The root is taken of
    ``max(v, smallest normal)`` instead: sqrt of that is ~1e-19 in fp32, below half an ulp of any eps
    above 1e-11, so ``sqrt(v) + eps`` rounds to the same value."""
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    if eps_inside_sqrt:
        torch.add(v, eps, out=u).sqrt_()
    else:
        torch.clamp(v, min=torch.finfo(v.dtype).tiny, out=u).sqrt_().add_(eps)
    torch.div(m, u, out=u)
    if decay:
        u.add_(w, alpha=decay)


def multi_tensor(
    slots: list[Slot], eps_inside_sqrt: bool, grad_scale: torch.Tensor | None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The multi-tensor passes: what :func:`sweep_cpu` returns, a few launches per set of group settings
    (usually one set). ``grad_scale``: the clip coefficient as a device scalar (None: no clip)."""
    if grad_scale is not None:
        torch._foreach_mul_([slot.g for slot in slots], grad_scale)
    updates: list[torch.Tensor] = [torch.empty(0)] * len(slots)
    by_settings: dict[tuple, list[int]] = {}
    for i, slot in enumerate(slots):
        by_settings.setdefault(slot.settings, []).append(i)
    for (beta1, beta2, eps, decay), members in by_settings.items():
        w, g, m, v = ([getattr(slots[i], name) for i in members] for name in ("w", "g", "m", "v"))
        torch._foreach_lerp_(m, g, 1.0 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)
        if eps_inside_sqrt:
            denom = torch._foreach_add(v, eps)
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(v)
            torch._foreach_add_(denom, eps)
        u = torch._foreach_div(m, denom)
        del denom
        if decay:
            torch._foreach_add_(u, w, alpha=decay)
        for i, update in zip(members, u):
            updates[i] = update
    weights = [p for slot in slots for p in pieces(slot.w, slot.fragments)]
    parts = [p for slot, u in zip(slots, updates) for p in pieces(u, slot.fragments)]
    if not weights:
        return updates, torch.zeros(2, 0, dtype=torch.float64, device=slots[0].w.device)
    norms = torch.stack(torch._foreach_norm(weights + parts)).double().square_()
    return updates, norms.view(2, len(weights))


def apply_updates(
    slots: list[Slot],
    updates: list[torch.Tensor],
    ratios: torch.Tensor,
    step_sizes: list[float],
    multi: bool,
) -> None:
    """``w += step_size * r * u`` for every fragment (``ratios``, ``step_sizes``: one each, in slot
    order); padding (elements outside every fragment) is never moved. ``multi``: one multi-tensor op that
    keeps the ratios on the device; else (CPU) the ratios are read (no wait there), one ``add_`` each."""
    weights = [p for slot in slots for p in pieces(slot.w, slot.fragments)]
    parts = [p for slot, u in zip(slots, updates) for p in pieces(u, slot.fragments)]
    if not weights:
        return
    if not multi:
        for weight, part, ratio, step_size in zip(weights, parts, ratios.tolist(), step_sizes):
            weight.add_(part, alpha=step_size * ratio)
        return
    torch._foreach_addcmul_(weights, parts, list(ratios.unbind(0)), step_sizes)
