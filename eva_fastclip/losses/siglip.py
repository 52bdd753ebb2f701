"""SigLIP's sigmoid loss (Zhai et al., ICCV 2023): every image-text pair of the batch is its own binary
classification, with a learned scale t and bias b,

    L = -1/|B| · Σ_i Σ_j log σ(z_ij (t·x_i·y_j + b)),    z_ij = 1 for a matching pair, -1 otherwise.

Distributed the way our other losses are: features are all-gathered without autograd, and rank k takes
the terms of its own anchors (rows: its images against all G texts) and of its own candidates (columns:
all G images against its texts). The rows carry the gradients of its images, of t and of b; the columns
the gradients of its texts (t and b held fixed there: each pair's terms reach t and b once, through the
rank that owns its row). Scaled by 1/b, the engine's mean over ranks is then exactly the gradient of L,
and no collective carries a feature gradient. open_clip's ``SigLipLoss`` instead passes the texts around
the ranks with autograd (``dist_impl`` bidir, shift, reduce or gather) and sends their gradients back.

The terms are summed in row blocks (:class:`_PairTerms`): the forward keeps no b×G logits and the
backward recomputes each block, so the loss's memory per rank is the gathered features plus one block
(docs/losses.md; ``python -m benchmarks.loss_memory --loss siglip`` measures it beside open_clip's).

A cached step (``train.contrastive_batch: global``) is the same reduction with each (rank, micro-batch)
as a "rank": its rows and columns against all G pairs of the optimizer step, scaled by 1/b.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eva_fastclip.losses.base import ContrastiveLoss, LossOutput

_BLOCK_ELEMENTS = 2**22  # logits of one row block: 16 MiB in fp32 (a few such tensors live at once)


class SigLipLoss(ContrastiveLoss):
    """``loss.name: siglip``. Takes the model's ``logit_scale`` (t, already exponentiated) and
    ``logit_bias`` (b) beside the features. The loss's value (and the metric ``loss/contrastive``) is the
    rank's share of L, its rows' terms over b: the value open_clip's ``SigLipLoss`` returns on that rank;
    the mean over ranks is L."""

    uses_logit_bias = True

    def forward(self, image_features, text_features, logit_scale, indices, logit_bias=None) -> LossOutput:
        self.begin_cached_step(image_features, text_features, logit_scale, indices, image_features.shape[0])
        try:
            return self.cached_forward(image_features, text_features, logit_scale, 0, logit_bias=logit_bias)
        finally:
            self.end_cached_step()

    def begin_cached_step(self, image_features, text_features, logit_scale, indices, micro_batch) -> None:
        """Every pair's features of the step (gathered, no autograd): the candidates of every row and the
        anchors of every column."""
        e1_all, e2_all, own = self._gather_step(image_features, text_features, micro_batch)
        self._cached = _CachedPairs(e1_all, e2_all, own.start, micro_batch)

    def cached_forward(
        self, image_features, text_features, logit_scale, micro, logit_bias=None
    ) -> LossOutput:
        """Micro-batch ``micro``'s rows and columns against all G pairs of the step, over b."""
        if logit_bias is None:
            raise ValueError(
                "loss.name=siglip needs the model's logit_bias: build the model with loss.logit_bias_init "
                "(eva_fastclip's create_model does for loss.name=siglip)"
            )
        cached = self._cached
        b = image_features.shape[0]
        if b != cached.micro_batch:
            raise ValueError(f"a micro-batch of {b} pairs in a step of micro-batches of {cached.micro_batch}")
        offset = cached.offset + micro * b
        matches = torch.arange(offset, offset + b, device=image_features.device)
        scale, bias = logit_scale.reshape(()), logit_bias.reshape(()).to(logit_scale.dtype)
        rows = _PairTerms.apply(image_features, cached.e2_all, scale, bias, matches)
        columns = _PairTerms.apply(text_features, cached.e1_all, scale.detach(), bias.detach(), matches)
        # the value is the rows' (this rank's share of L, as open_clip's SigLipLoss reports it), the gradient
        # both halves'
        loss = (rows + (columns - columns.detach())) / b
        metrics = {
            "loss/contrastive": rows.item() / b,
            "temperature": 1.0 / scale.item(),
            "logit_bias": bias.item(),
        }
        return LossOutput(loss, metrics)


@dataclass
class _CachedPairs:
    """Every pair's features of the step ([G, d] each, no autograd), where this rank's start among them,
    and the step's micro-batch."""

    e1_all: torch.Tensor
    e2_all: torch.Tensor
    offset: int
    micro_batch: int


def _signed_logits(anchors, candidates, scale, bias, matches, rows: slice, keep_cosines: bool = False):
    """-z·(t·a·c + b) for anchors ``rows`` against every candidate: the argument of softplus
    (−log σ(u) = softplus(−u)), its sign flipped on each anchor's match; and the cosines a·c when
    ``keep_cosines`` (else the logits are made in their place: one block fewer)."""
    cosines = anchors[rows] @ candidates.T
    signed = (cosines * scale if keep_cosines else cosines.mul_(scale)).add_(bias)
    _negate_matches(signed, matches, rows)
    return signed, cosines if keep_cosines else None


def _negate_matches(block, matches, rows: slice) -> None:
    """Flip the sign, in place, of each anchor's entry at its match in a row block (z_ij = +1 there)."""
    local = torch.arange(rows.stop - rows.start, device=block.device)
    block[local, matches[rows]] = -block[local, matches[rows]]


class _PairTerms(torch.autograd.Function):
    """Σ_ij softplus(−z_ij (t·a_i·c_j + b)) over anchors a [n, d] (live) and candidates c [G, d] (fixed),
    anchor i matching candidate ``matches[i]``. Row blocks of at most _BLOCK_ELEMENTS logits, two
    block-sized tensors alive at once in either pass; the backward recomputes each block:
    d/ds softplus(−z·s) = −z·σ(−z·s)."""

    @staticmethod
    def forward(ctx, anchors, candidates, scale, bias, matches):
        step = max(1, _BLOCK_ELEMENTS // candidates.shape[0])
        total = anchors.new_zeros(())
        for start in range(0, anchors.shape[0], step):
            rows = slice(start, min(anchors.shape[0], start + step))
            signed = _signed_logits(anchors, candidates, scale, bias, matches, rows)[0]
            total += F.softplus(signed).sum()
            del signed  # before the next block is made
        ctx.save_for_backward(anchors, candidates, scale, bias, matches)
        ctx.step = step
        return total

    @staticmethod
    def backward(ctx, grad_total):
        anchors, candidates, scale, bias, matches = ctx.saved_tensors
        grad_anchors = torch.empty_like(anchors) if ctx.needs_input_grad[0] else None
        grad_scale, grad_bias = scale.new_zeros(()), bias.new_zeros(())
        for start in range(0, anchors.shape[0], ctx.step):
            rows = slice(start, min(anchors.shape[0], start + ctx.step))
            signed, cosines = _signed_logits(anchors, candidates, scale, bias, matches, rows, True)
            grad = signed.sigmoid_()  # d softplus(u)/du; u = −z·s, so d/ds = −z·σ(u)
            _negate_matches(grad, matches, rows)
            grad *= grad_total  # now d total / d s
            if grad_anchors is not None:
                grad_anchors[rows] = scale * (grad @ candidates)
            grad_scale += torch.dot(grad.flatten(), cosines.flatten())
            grad_bias += grad.sum()
            del signed, grad, cosines  # before the next block is made
        return (
            grad_anchors,
            None,
            grad_scale if ctx.needs_input_grad[2] else None,
            grad_bias if ctx.needs_input_grad[3] else None,
            None,
        )
