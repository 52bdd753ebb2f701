"""What FastCLIP's own code computes, written out from the math (not from its code), so tests can compare
the options that claim to reproduce it: ``loss.tau_gradient=fastclip_code`` (v3) and the v2 per-sample
temperature update. docs/losses.md derives both from Optimization-AI/fast_clip's src/fast_clip/loss.py.
"""

import torch


def _inner(anchors, positives, negatives, scale, own_column):
    """Sum over the negatives (except the anchor's own pair, column ``own_column[i]``; -1: none present)
    of exp(scale * (anchor . negative - anchor . positive)), one value per anchor."""
    margin = anchors @ negatives.T - (anchors * positives).sum(dim=1, keepdim=True)
    terms = torch.exp(scale * margin)
    keep = torch.ones_like(terms)
    rows = torch.nonzero(own_column >= 0).flatten()
    keep[rows, own_column[rows]] = 0.0
    return (terms * keep).sum(dim=1)


def fastclip_v3_rank_loss(image, text, logit_scale, *, rank, world, rho, eps):
    """The scalar that rank ``rank`` of ``world`` back-propagates in FastCLIP-v3's first step (gamma = 1,
    so u = g), as a function of the global batch ``image``, ``text`` [n, d] and s = ``logit_scale`` = 1/tau.

    With b = n / world, L the rank's b pairs (the only rows that carry autograd: the rest are all-gathered
    copies) and tau_bar = 1/s detached:

        loss_k = tau_bar * (A + R) / 2 + rho * tau + tau * mean_{i in L} (log u1_i + log u2_i) / 2

        A = mean_{i in L}   [ g1_i / (u1_i + eps) + g2_i / (u2_i + eps) ]
        R = (1/b) sum_{j<n} [ h1_j / (u1_j + eps) + h2_j / (u2_j + eps) ]

    g_i: anchor i against all n negatives (detached copies), / (n - 1); h_j: anchor j (a detached copy)
    against only this rank's negatives, / (n - 1); u = g detached. s stays undetached in g, h, rho and the
    log-u term: that is where the code's tau-gradient counts the surrogate's tau-derivative in both A and R.
    """
    n = image.shape[0]
    b = n // world
    local = torch.arange(rank * b, (rank + 1) * b)
    everyone = torch.arange(n)
    img, txt = image.detach(), text.detach()
    mine_img, mine_txt = image[local], text[local]

    # u: every anchor against every negative, nothing differentiated
    u1 = _inner(img, txt, txt, logit_scale.detach(), everyone) / (n - 1)
    u2 = _inner(txt, img, img, logit_scale.detach(), everyone) / (n - 1)
    # A: the rank's anchors (with autograd) against the all-gathered negatives (without, own rows too)
    g1 = _inner(mine_img, mine_txt, txt, logit_scale, local) / (n - 1)
    g2 = _inner(mine_txt, mine_img, img, logit_scale, local) / (n - 1)
    a = (g1 / (u1[local] + eps) + g2 / (u2[local] + eps)).mean()
    # R: every anchor (detached) against the rank's negatives; anchor j's own pair is column j - rank * b
    own = torch.where((everyone >= rank * b) & (everyone < (rank + 1) * b), everyone - rank * b, -1)
    h1 = _inner(img, txt, mine_txt, logit_scale, own) / (n - 1)
    h2 = _inner(txt, img, mine_img, logit_scale, own) / (n - 1)
    r = (h1 / (u1 + eps) + h2 / (u2 + eps)).sum() / b

    tau = 1.0 / logit_scale
    log_u = (torch.log(u1[local]) + torch.log(u2[local])).mean() / 2
    return (tau.detach() * (a + r) / 2 + rho * tau + tau * log_u).sum()


class IndividualTau:
    """FastCLIP-v2's per-sample temperature rule for one direction, from the math its code implements:

        g~ = clamp(grad, -5, 5)
        m <- beta1 m + (1 - beta1) g~,      v <- beta2 v + (1 - beta2) g~^2
        tau <- clamp(tau - lr * m_hat / (sqrt(v_hat) + eps), 0.01, 1),
        m_hat = m / (1 - beta1^(e+1)),      v_hat = v / (1 - beta2^(e+1))

    with e the epoch and both betas 0 during epoch 0 (so the first epoch takes plain clipped sign-like
    steps, and later epochs correct by the epoch count, not the step count)."""

    def __init__(self, tau, lr_tau, betas=(0.9, 0.999), eps=1e-8, clip=5.0, bounds=(0.01, 1.0)):
        self.tau = tau.clone()
        self.m = torch.zeros_like(tau)
        self.v = torch.zeros_like(tau)
        self.lr, self.eps, self.clip, self.bounds = lr_tau, eps, clip, bounds
        self.later_betas = betas
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def step(self, grad):
        beta1, beta2 = self.later_betas if self.epoch > 0 else (0.0, 0.0)
        g = grad.clamp(-self.clip, self.clip)
        self.m = beta1 * self.m + (1.0 - beta1) * g
        self.v = beta2 * self.v + (1.0 - beta2) * g**2
        m_hat = self.m / (1.0 - beta1 ** (self.epoch + 1))
        v_hat = self.v / (1.0 - beta2 ** (self.epoch + 1))
        self.tau = (self.tau - self.lr * m_hat / (v_hat.sqrt() + self.eps)).clamp(*self.bounds)
