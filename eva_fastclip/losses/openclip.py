"""The OpenCLIP baseline: mini-batch symmetric InfoNCE, local rows against gathered negatives."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eva_fastclip.losses.base import ContrastiveLoss, LossOutput

_BLOCK_ELEMENTS = 2**22  # logits of one row block in begin_cached_step: 16 MiB in fp32


class OpenClipLoss(ContrastiveLoss):
    """OpenCLIP's ``ClipLoss(local_loss=True, gather_with_grad=True)``.

    Rank k scores its b local anchors against all B gathered pairs (rows [k·b, (k+1)·b) of the logit
    matrix, as in DisCo-CLIP) and the gather keeps autograd, so the sum over ranks of the gradients equals
    the gradient of the full-batch loss. The temperature comes from the model's parameter log(1/tau),
    learnable by default and kept in [0.01, 1] (log(1/tau) in [0, ln 100]) by the temperature controller.

    A cached step (``train.contrastive_batch: global``) takes the same loss over all G pairs of the
    optimizer step without sending any feature gradient. For L = 1/(2G)·Σ_i (CE_i^img + CE_i^txt), the
    gradient through micro-batch v's features is that of its own rows (its anchors against all G, its
    pairs live) plus, through its pairs as the other anchors' negatives, Σ_{i∉v} p_ij·s·e_i with p_ij the
    other row's softmax, which the row log-sum-exps of the cached features give. Micro-batch v backpropagates
    (G/b)·∂L/∂(its features): the engine's mean over ranks and micro-batches then gives ∇L exactly.
    OpenCLIP's own ``--accum-freq`` evaluates the whole G×G loss once per micro-batch instead.
    """

    def forward(self, image_features, text_features, logit_scale, indices) -> LossOutput:
        all_images = self.gatherer.gather_with_grad(image_features)
        all_texts = self.gatherer.gather_with_grad(text_features)
        scale = logit_scale.reshape(())
        logits_per_image = scale * image_features @ all_texts.T
        logits_per_text = scale * text_features @ all_images.T
        local = image_features.shape[0]
        labels = torch.arange(local, device=image_features.device) + self.gatherer.rank * local
        loss = 0.5 * (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels))
        return LossOutput(loss, {"loss/contrastive": loss.item(), "temperature": 1.0 / scale.item()})

    # ---- the cached step -----------------------------------------------------------------------------

    def begin_cached_step(self, image_features, text_features, logit_scale, indices, micro_batch) -> None:
        """Every pair's features, and each row's log-sum-exp over all G (this rank's rows, gathered)."""
        g = self.gatherer
        n = image_features.shape[0]
        e1_all, e2_all, own = self._gather_step(image_features, text_features, micro_batch)
        scale = logit_scale.detach().reshape(())
        lse_img, lse_txt = image_features.new_empty(n), image_features.new_empty(n)
        step = max(1, _BLOCK_ELEMENTS // e1_all.shape[0])
        for start in range(0, n, step):  # row blocks: nothing of size n×G at once
            rows = slice(own.start + start, own.start + min(n, start + step))
            lse_img[start : start + step] = torch.logsumexp(scale * e1_all[rows] @ e2_all.T, dim=1)
            lse_txt[start : start + step] = torch.logsumexp(scale * e2_all[rows] @ e1_all.T, dim=1)
        self._cached = _CachedPairs(
            e1_all,
            e2_all,
            g.gather(lse_img, purpose="row_lse"),
            g.gather(lse_txt, purpose="row_lse"),
            own.start,
            micro_batch,
        )

    def cached_forward(self, image_features, text_features, logit_scale, micro) -> LossOutput:
        """Its rows' cross-entropies over all G (its pairs live), plus a term whose value is zero and
        whose gradient is that of the other rows through its pairs as their negatives."""
        cached = self._cached
        b = image_features.shape[0]
        if b != cached.micro_batch:
            raise ValueError(f"a micro-batch of {b} pairs in a step of micro-batches of {cached.micro_batch}")
        offset = cached.offset + micro * b
        local = slice(offset, offset + b)
        scale = logit_scale.reshape(())
        all_images = torch.cat([cached.e1_all[:offset], image_features, cached.e1_all[local.stop :]])
        all_texts = torch.cat([cached.e2_all[:offset], text_features, cached.e2_all[local.stop :]])
        labels = torch.arange(b, device=image_features.device) + offset
        contrastive = 0.5 * (
            F.cross_entropy(scale * image_features @ all_texts.T, labels)
            + F.cross_entropy(scale * text_features @ all_images.T, labels)
        )
        # the other rows i: d CE_i / d e_j = p_ij·s·e_i for j in this micro-batch (s: no gradient here,
        # its own rows carry the temperature's)
        s = scale.detach()
        as_negatives = image_features.new_zeros(())
        for anchors, lse, negatives in ((cached.e1_all, cached.lse_img, text_features),
                                        (cached.e2_all, cached.lse_txt, image_features)):  # fmt: skip
            logits = s * anchors @ negatives.T  # [G, b]
            p = torch.exp(logits.detach() - lse.unsqueeze(1))
            p[local] = 0.0  # its own rows are in the cross-entropies
            as_negatives = as_negatives + (p * logits).sum()
        as_negatives = 0.5 / b * as_negatives
        loss = contrastive + (as_negatives - as_negatives.detach())
        return LossOutput(loss, {"loss/contrastive": contrastive.item(), "temperature": 1.0 / scale.item()})


@dataclass
class _CachedPairs:
    e1_all: torch.Tensor  # [G, d] every pair's image features (no autograd)
    e2_all: torch.Tensor
    lse_img: torch.Tensor  # [G] each image anchor's log-sum-exp over the G texts
    lse_txt: torch.Tensor
    offset: int  # where this rank's pairs start among the G
    micro_batch: int
