"""SigLIP's loss as its paper writes it (Zhai et al. 2023, Algorithm 1 and eq. 1), term by term in float64,
and the inputs the parity tests share (tests/test_siglip_loss.py, tests/launched/test_siglip_two_ranks.py).
"""

import math

import torch
import torch.nn.functional as F

B, D = 12, 8
LOG_SCALE, BIAS = math.log(10.0), -10.0  # SigLIP's initial t = 10 and b = -10


def paper_loss(images, texts, t, b):
    """-1/|B| sum_i sum_j log sigmoid(z_ij (t x_i.y_j + b)), z_ij = 1 if i == j else -1: term by term."""
    n = images.shape[0]
    total = images.new_zeros(())
    for i in range(n):
        for j in range(n):
            z = 1.0 if i == j else -1.0
            total = total - torch.log(torch.sigmoid(z * (t * images[i] @ texts[j] + b)))
    return total / n


def pairs(seed: int = 0, n: int = B, d: int = D, bias: float = BIAS):
    """Unit features (float64 leaves), log t and b as [1] leaves, the paper's loss and its gradients.

    ``bias`` near 0 makes the negatives weigh as much as the positives (at b = -10 they are ~e^-10)."""
    g = torch.Generator().manual_seed(seed)
    images = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1).requires_grad_(True)
    texts = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1).requires_grad_(True)
    log_t = torch.tensor([LOG_SCALE], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([bias], dtype=torch.float64, requires_grad=True)
    loss = paper_loss(images, texts, log_t.exp(), b)
    grads = torch.autograd.grad(loss, (images, texts, log_t, b))
    return (images.detach(), texts.detach(), log_t.detach(), b.detach()), loss.item(), grads
