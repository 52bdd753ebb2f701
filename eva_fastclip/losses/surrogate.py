"""Memory-lean kernels of the compositional surrogate: statistics in one pass, gradient by recomputation.

Rank k holds b local pairs and all B gathered embeddings E1, E2 (no autograd). With A = e1·E2ᵀ and
T = e2·E1ᵀ (b×B), every quantity of the loss is elementwise in (i, j) given O(B) per-row / per-column
constants:

    local image anchor i:   d1_ij = (A_ij − p_i)/τ1_i        local text anchor i:   d2_ij = (T_ij − p_i)/τ2_i
    remote text anchor j:   d̂2_ji = (A_ij − P_j)/τ2_j        remote image anchor j: d̂1_ji = (T_ij − P_j)/τ1_j

(p_i = e1_i·e2_i, P_j = E1_j·E2_j; the entry of a pair with itself is excluded). So the forward pass
streams row blocks of A and T and keeps only row statistics and column statistics (an online
log-sum-exp), and the backward pass recomputes each block to form its gradient. Nothing of size b×B is
kept between the passes, and a block has at most ``_BLOCK_ELEMENTS`` entries: the loss's memory is
O(b·d + B·d) plus one block, where a plain autograd graph keeps a dozen b×B tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_BLOCK_ELEMENTS = 2**18  # entries of one row block of A (and of T): 1 MiB each in fp32


@dataclass
class Stats:
    """Per local anchor (rows) and per global anchor (columns), over the anchor's negatives:
    the shift c (a detached maximum), s = Σ exp(d − c), and for rows sd = Σ exp(d − c)·d."""

    row_c1: torch.Tensor
    row_s1: torch.Tensor
    row_sd1: torch.Tensor
    row_c2: torch.Tensor
    row_s2: torch.Tensor
    row_sd2: torch.Tensor
    col_c1: torch.Tensor
    col_s1: torch.Tensor
    col_c2: torch.Tensor
    col_s2: torch.Tensor


@dataclass
class Operands:
    """What both passes need: local features, gathered features, positives, temperatures, masking."""

    e1: torch.Tensor  # [b, d] local image embeddings
    e2: torch.Tensor  # [b, d] local text embeddings
    all1: torch.Tensor  # [B, d] gathered image embeddings (detached)
    all2: torch.Tensor  # [B, d] gathered text embeddings (detached)
    tau1: torch.Tensor  # [b] temperature of each local image anchor
    tau2: torch.Tensor  # [b]
    tau1_all: torch.Tensor  # [B] temperature of each image anchor, for the remote half (detached)
    tau2_all: torch.Tensor  # [B]
    offset: int  # position of the local pairs among the B gathered ones

    def blocks(self):
        """Row blocks: (rows, A block, T block, d1, d2, d̂2 as rows×B, d̂1 as rows×B, mask)."""
        b, big_b = self.e1.shape[0], self.all1.shape[0]
        step = max(1, min(math.ceil(b / 4), _BLOCK_ELEMENTS // big_b))
        positives = (self.e1 * self.e2).sum(-1)
        positives_all = (self.all1 * self.all2).sum(-1)
        for start in range(0, b, step):
            rows = slice(start, min(b, start + step))
            a = self.e1[rows] @ self.all2.T
            t = self.e2[rows] @ self.all1.T
            mask = torch.ones_like(a, dtype=torch.bool)
            local = torch.arange(rows.start, rows.stop, device=a.device)
            mask[local - rows.start, local + self.offset] = False
            p = positives[rows].unsqueeze(1)
            yield (
                rows,
                a,
                t,
                (a - p) / self.tau1[rows].unsqueeze(1),
                (t - p) / self.tau2[rows].unsqueeze(1),
                (a - positives_all) / self.tau2_all,
                (t - positives_all) / self.tau1_all,
                mask,
            )


def statistics(ops: Operands, columns: bool = True) -> Stats:
    """One streaming pass over the row blocks (no autograd); ``columns=False`` leaves the column
    statistics empty (zeros), for a caller that needs only the rows'."""
    b, big_b = ops.e1.shape[0], ops.all1.shape[0]
    new = ops.e1.new_empty
    rows = {k: new(b) for k in ("c1", "s1", "sd1", "c2", "s2", "sd2")}
    col_c = [torch.full((big_b,), -math.inf, dtype=ops.e1.dtype, device=ops.e1.device) for _ in range(2)]
    col_s = [ops.e1.new_zeros(big_b) for _ in range(2)]
    with torch.no_grad():
        for r, _, _, d1, d2, dhat2, dhat1, mask in ops.blocks():
            for k, d in ((1, d1), (2, d2)):
                c = _finite(torch.where(mask, d, -math.inf).amax(dim=1))
                w = torch.exp(torch.where(mask, d - c.unsqueeze(1), -math.inf))
                rows[f"c{k}"][r], rows[f"s{k}"][r] = c, w.sum(dim=1)
                rows[f"sd{k}"][r] = (w * torch.where(mask, d, 0.0)).sum(dim=1)
            for k, d in ((0, dhat1), (1, dhat2)) if columns else ():  # online log-sum-exp down the columns
                block_c = torch.where(mask, d, -math.inf).amax(dim=0)
                c = torch.maximum(col_c[k], block_c)
                safe = _finite(c)
                col_s[k] = col_s[k] * torch.exp(col_c[k] - safe).nan_to_num(0.0) + torch.exp(
                    torch.where(mask, d - safe, -math.inf)
                ).sum(dim=0)
                col_c[k] = c
            # free this block before the generator builds the next: two blocks alive would double the peak
            del _, d1, d2, dhat2, dhat1, mask, d, c, w
            if columns:
                del block_c, safe
    return Stats(
        rows["c1"], rows["s1"], rows["sd1"], rows["c2"], rows["s2"], rows["sd2"],
        _finite(col_c[0]), col_s[0], _finite(col_c[1]), col_s[1],
    )  # fmt: skip


class Surrogate(torch.autograd.Function):
    """Φ_k = ½ [ Σ_i (r1_i·s1_i + r2_i·s2_i) + Σ_j (q1_j·ŝ1_j + q2_j·ŝ2_j) ], where the detached
    coefficients r (rows) and q (columns) carry the exp(c), the 1/((B−1)(u+ε)) factors, the weights and
    the means. Gradients flow to e1, e2 and, for ``tau_halves`` "local", through the local half to a
    global tau (the exact gradient once the engine averages the ranks), or for "both" through both
    halves as FastCLIP's code lets them (its τ-derivative twice, docs/losses.md); None: no tau gradient."""

    @staticmethod
    def forward(ctx, e1, e2, tau, ops: Operands, stats: Stats, coef: dict, tau_halves: str | None):
        ctx.ops, ctx.stats, ctx.coef, ctx.tau_halves = ops, stats, coef, tau_halves
        value = (
            (coef["r1"] * stats.row_s1).sum()
            + (coef["r2"] * stats.row_s2).sum()
            + (coef["q1"] * stats.col_s1).sum()
            + (coef["q2"] * stats.col_s2).sum()
        )
        return value

    @staticmethod
    def backward(ctx, grad_out):
        ops, st, coef = ctx.ops, ctx.stats, ctx.coef
        grad_e1, grad_e2 = torch.zeros_like(ops.e1), torch.zeros_like(ops.e2)
        grad_tau = ops.e1.new_zeros(())
        for r, _, _, d1, d2, dhat2, dhat1, mask in ops.blocks():
            # dΦ/d(entry) of each of the four terms, masked
            p1 = torch.where(mask, torch.exp(d1 - st.row_c1[r].unsqueeze(1)), 0.0) * coef["r1"][r].unsqueeze(
                1
            )
            p2 = torch.where(mask, torch.exp(d2 - st.row_c2[r].unsqueeze(1)), 0.0) * coef["r2"][r].unsqueeze(
                1
            )
            q1 = torch.where(mask, torch.exp(dhat1 - st.col_c1), 0.0) * coef["q1"]
            q2 = torch.where(mask, torch.exp(dhat2 - st.col_c2), 0.0) * coef["q2"]
            grad_a = p1 / ops.tau1[r].unsqueeze(1) + q2 / ops.tau2_all  # A feeds d1 and d̂2
            grad_t = p2 / ops.tau2[r].unsqueeze(1) + q1 / ops.tau1_all  # T feeds d2 and d̂1
            grad_p = -(p1.sum(1) / ops.tau1[r] + p2.sum(1) / ops.tau2[r])  # p_i = e1_i·e2_i in d1, d2
            grad_e1[r] = grad_a @ ops.all2 + grad_p.unsqueeze(1) * ops.e2[r]
            grad_e2[r] = grad_t @ ops.all1 + grad_p.unsqueeze(1) * ops.e1[r]
            if ctx.tau_halves is not None:  # d(d)/d(tau) = −d/tau
                grad_tau = grad_tau - (
                    (p1 * torch.where(mask, d1, 0.0)).sum() + (p2 * torch.where(mask, d2, 0.0)).sum()
                )
            if ctx.tau_halves == "both":
                grad_tau = grad_tau - (
                    (q1 * torch.where(mask, dhat1, 0.0)).sum() + (q2 * torch.where(mask, dhat2, 0.0)).sum()
                )
            del _, d1, d2, dhat2, dhat1, mask, p1, p2, q1, q2, grad_a, grad_t  # (as in statistics)
        grad_tau = grad_tau / ops.tau1[0] if ctx.tau_halves is not None else None
        # in place: two more b×d copies would be the largest buffers of the whole loss step
        return (
            grad_e1.mul_(grad_out),
            grad_e2.mul_(grad_out),
            (grad_out * grad_tau if ctx.tau_halves is not None else None),
            None,
            None,
            None,
            None,
        )


def _finite(c: torch.Tensor) -> torch.Tensor:
    """Shifts of rows or columns with no entries (b = 1) are -inf: use 0, their sums are 0 anyway."""
    return torch.where(torch.isfinite(c), c, torch.zeros_like(c))
