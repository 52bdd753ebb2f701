"""The OpenCLIP baseline: mini-batch symmetric InfoNCE, local rows against gathered negatives."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eva_fastclip.losses.base import ContrastiveLoss, LossOutput


class OpenClipLoss(ContrastiveLoss):
    """OpenCLIP's ``ClipLoss(local_loss=True, gather_with_grad=True)``.

    Rank k scores its b local anchors against all B gathered pairs (rows [k·b, (k+1)·b) of the logit
    matrix, as in DisCo-CLIP) and the gather keeps autograd, so the sum over ranks of the gradients equals
    the gradient of the full-batch loss. The temperature comes from the model's parameter log(1/tau),
    learnable by default and kept in [0.01, 1] (log(1/tau) in [0, ln 100]) by the temperature controller.
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
