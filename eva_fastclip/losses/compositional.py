"""The global contrastive loss family optimised by compositional (FCCO) updates: SogCLR, iSogCLR and
FastCLIP v0-v3, as one class configured by ``LossConfig`` (docs/losses.md has the math).

For pair i with L2-normalised image/text embeddings e1_i, e2_i and d_ij = (e1_i·e2_j - e1_i·e2_i)/tau_i,
    g1_i = 1/(B-1) · sum_{j != i} exp(d_ij)          (and g2_i the mirror, text anchors)
    u_i  <- (1-gamma)·u_i + gamma·g_i                (u_i <- g_i if the stored u_i < 1e-35, inf or NaN)
and the gradient goes through the surrogate
    Phi  = mean_i 1/2 [ w1_i·g1_i/(u1_i+eps) + w2_i·g2_i/(u2_i+eps) ]    (w = tau_i for RGCL, else 1)
whose gradient, when u = g, is the gradient of the objective
    GCL:    mean_i 1/2 [ log(eps+g1_i) + log(eps+g2_i) ]                     (SogCLR, v0, v1)
    RGCL:   mean_i 1/2 [ tau1_i (log(eps+g1_i)+rho) + tau2_i (log(eps+g2_i)+rho) ]   (v2, iSogCLR)
    RGCL-g: tau · mean_i 1/2 [ log(eps+g1_i) + log(eps+g2_i) ] + rho·tau     (v3, surrogate below)
(the 1/2 averages the two directions, as OpenCLIP's loss does; it keeps rho on the reference's scale).
``loss.tau_gradient: fastclip_code`` instead gives v3's tau the gradient FastCLIP's code computes: Phi's
tau-derivative twice (both halves below carry tau) and log u without eps (docs/losses.md derives it).

Distributed reduction (FastCLIP): features are all-gathered without autograd; rank k computes g only for
its b anchors against all B negatives (the local half, gradient through the anchors) and, for all B
anchors, the part of g whose negatives are its own pairs (the remote half, gradient through the local
negatives, scaled by B/b). The engine's gradient average over ranks then gives exactly the gradient of
Phi; no collective carries feature gradients. Exponentials are taken against a detached per-row maximum
and u is kept as log u, so nothing overflows in fp32 down to tau = 0.01.

A cached step (``begin_cached_step``, ``cached_forward``) is the same reduction with (rank, micro-batch)
pairs as the "ranks": B is the whole step's G pairs, u and tau_i are updated once over them, and the
engine's mean over ranks and micro-batches completes the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eva_fastclip.config import LossConfig
from eva_fastclip.losses.base import ContrastiveLoss, LossOutput
from eva_fastclip.losses.gather import Gatherer
from eva_fastclip.losses.state import PerSampleTable
from eva_fastclip.losses.surrogate import Operands, Stats, Surrogate, statistics
from eva_fastclip.optim.temperature import TemperatureController

_LOG_TINY = math.log(1e-35)  # a stored u below this is treated as unset (SPEC's reset rule)


class CompositionalLoss(ContrastiveLoss):
    def __init__(
        self,
        cfg: LossConfig,
        *,
        dataset_size: int,
        gatherer: Gatherer | None = None,
        temperature: TemperatureController | None = None,
    ) -> None:
        super().__init__(gatherer)
        self.cfg = cfg
        self.temperature = temperature or TemperatureController.from_config(cfg)
        self.individual = self.temperature.is_individual
        self.rgcl_g = self.temperature.rule == "rgcl_g"
        self.fastclip_code = cfg.tau_gradient == "fastclip_code"
        self.log_eps = math.log(cfg.eps)
        fields = {"log_u1": -math.inf, "log_u2": -math.inf}
        if self.individual:
            fields |= {"tau1": cfg.temperature_init, "tau2": cfg.temperature_init, "m1": 0.0, "m2": 0.0}
            if self.temperature.rule == "individual_adam":
                fields |= {"v1": 0.0, "v2": 0.0}
        self.state = PerSampleTable(dataset_size, fields, self.gatherer)
        self.epoch = 0
        self._cached: _CachedPairs | None = None

    # ---- schedule -------------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def gamma(self) -> float:
        """Inner rate of the u estimators for the current epoch: 1 in the first, then the schedule."""
        cfg = self.cfg
        if self.epoch == 0:
            return 1.0
        if cfg.gamma_schedule == "cosine" and cfg.gamma_decay_epochs is None:
            raise ValueError(
                f"loss {cfg.name!r}: gamma decays over loss.gamma_decay_epochs, which is not set; set it "
                "(FastCLIP: half the run's epochs), e.g. build_loss(..., gamma_decay_epochs=E)"
            )
        if cfg.gamma_schedule == "constant" or self.epoch >= cfg.gamma_decay_epochs:
            return cfg.gamma_min
        return (
            0.5 * (1 + math.cos(math.pi * self.epoch / cfg.gamma_decay_epochs)) * (1 - cfg.gamma_min)
            + cfg.gamma_min
        )

    # ---- the step -------------------------------------------------------------------------------------

    def forward(self, image_features, text_features, logit_scale, indices) -> LossOutput:
        """One loss evaluation over this micro-batch and the other ranks' (the contrastive batch)."""
        self.begin_cached_step(image_features, text_features, logit_scale, indices, image_features.shape[0])
        try:
            return self.cached_forward(image_features, text_features, logit_scale, 0)
        finally:
            self.end_cached_step()

    def begin_cached_step(self, image_features, text_features, logit_scale, indices, micro_batch) -> None:
        """g for this rank's anchors against every pair of the step, the new u (and tau_i) of every pair,
        staged once; what ``cached_forward`` needs is kept. In a cached step the "ranks" of the reduction
        are (rank, micro-batch) pairs: each micro-batch's gradient goes through its own anchors and its
        own negatives, and their mean over ranks and micro-batches is the gradient over all G pairs."""
        g = self.gatherer
        n = image_features.shape[0]
        e1_all, e2_all, own = self._gather_step(image_features, text_features, micro_batch)
        idx_all = g.gather(indices, purpose="indices")
        big_b = e1_all.shape[0]
        if big_b < 2:
            raise ValueError("the global contrastive loss needs at least 2 pairs per step across ranks")
        # [B, F]: the committed state of every pair in the step (computed on in the features' precision)
        rows = self.state.lookup(idx_all).to(image_features.dtype)
        col = self.state.column
        if self.individual:
            tau1_all, tau2_all = rows[:, col("tau1")], rows[:, col("tau2")]
        else:  # one global tau, shared by every anchor
            tau1_all = tau2_all = (1.0 / logit_scale).detach().reshape(()).expand(big_b)
        ops = Operands(
            image_features.detach(), text_features.detach(), e1_all, e2_all,
            tau1_all[own], tau2_all[own], tau1_all, tau2_all, own.start,
        )  # fmt: skip
        # one streaming pass: nothing of size n×B is kept; the columns only where they are micro-batch 0's
        stats = statistics(ops, columns=n == micro_batch)
        log_norm = math.log(big_b - 1)
        log_g1 = stats.row_c1 + stats.row_s1.log() - log_norm  # log g for this rank's anchors
        log_g2 = stats.row_c2 + stats.row_s2.log() - log_norm

        gamma = self.gamma()
        new_rows = rows[own].clone()
        log_u1 = _update_log_u(rows[own, col("log_u1")], log_g1, gamma)
        log_u2 = _update_log_u(rows[own, col("log_u2")], log_g2, gamma)
        new_rows[:, col("log_u1")], new_rows[:, col("log_u2")] = log_u1, log_u2
        log_eps = torch.tensor(self.log_eps, dtype=log_u1.dtype, device=log_u1.device)
        log_den1, log_den2 = torch.logaddexp(log_u1, log_eps), torch.logaddexp(log_u2, log_eps)  # log(u+eps)
        tau1, tau2 = tau1_all[own], tau2_all[own]
        if self.individual:
            self._step_individual_tau(
                new_rows, (tau1, tau2), (stats.row_c1, stats.row_c2), (stats.row_sd1, stats.row_sd2),
                (log_den1, log_den2), big_b,
            )  # fmt: skip
        new_all = g.gather(new_rows, purpose="state_update")  # [B, F]: every pair's new state
        self.state.stage(idx_all, new_all)

        log_eps_g1 = torch.logaddexp(log_g1, log_eps)  # log(eps + g)
        log_eps_g2 = torch.logaddexp(log_g2, log_eps)
        gcl = float(0.5 * (log_eps_g1 + log_eps_g2).mean())
        metrics = {"gamma": gamma, "state/log_u_mean": float(0.5 * (log_u1 + log_u2).mean())}
        if self.rgcl_g:
            tau_value = float(tau1_all[0])
            objective = tau_value * gcl + self.cfg.rho * tau_value
        elif self.individual:
            objective = float(
                0.5 * (tau1 * (log_eps_g1 + self.cfg.rho) + tau2 * (log_eps_g2 + self.cfg.rho)).mean()
            )
            taus = torch.cat([new_rows[:, col("tau1")], new_rows[:, col("tau2")]])
            for q in (0.1, 0.5, 0.9):
                metrics[f"temperature_q{int(q * 100)}"] = float(taus.quantile(q))
        else:
            objective = gcl
        if not self.individual:
            metrics["temperature"] = float(tau1_all[0])
        metrics["loss/objective"] = objective
        # the batch's GCL, mean 1/2[log(eps+g1) + log(eps+g2)]: comparable across variants and temperatures
        metrics["loss/gcl"] = gcl
        self._cached = _CachedPairs(
            e1_all, e2_all, tau1_all, tau2_all, new_all, own.start, micro_batch,
            stats if n == micro_batch else None, metrics,
        )  # fmt: skip

    def cached_forward(self, image_features, text_features, logit_scale, micro) -> LossOutput:
        """Phi for micro-batch ``micro`` as one "rank" of the reduction: its b anchors against all B pairs
        (the local half) and all B anchors against its b negatives (the remote half, scaled by B/b)."""
        cached = self._cached
        b, big_b = image_features.shape[0], cached.e1_all.shape[0]
        if b != cached.micro_batch:
            raise ValueError(f"a micro-batch of {b} pairs in a step of micro-batches of {cached.micro_batch}")
        offset = cached.offset + micro * b
        local = slice(offset, offset + b)
        col = self.state.column
        tau = None
        if not self.individual:
            tau = (1.0 / logit_scale).reshape(())
            if not self.temperature.learns_global:
                tau = tau.detach()
        tau1_all, tau2_all = cached.tau1_all, cached.tau2_all
        tau1, tau2 = tau1_all[local], tau2_all[local]
        ops = Operands(
            image_features.detach(), text_features.detach(), cached.e1_all, cached.e2_all,
            tau1, tau2, tau1_all, tau2_all, offset,
        )  # fmt: skip
        stats = cached.stats if micro == 0 and cached.stats is not None else statistics(ops)

        # Phi's coefficients: local rows g/(u+eps) and, for all B anchors, (B/b)·ĝ/(u+eps), halved and meaned
        log_eps = torch.tensor(self.log_eps, dtype=image_features.dtype, device=image_features.device)
        log_den1_all = torch.logaddexp(cached.new_all[:, col("log_u1")], log_eps)
        log_den2_all = torch.logaddexp(cached.new_all[:, col("log_u2")], log_eps)
        log_den1, log_den2 = log_den1_all[local], log_den2_all[local]
        log_norm = math.log(big_b - 1)
        log_remote = math.log(big_b / b) - log_norm
        w1, w2 = (tau1, tau2) if self.individual else (1.0, 1.0)  # RGCL weighs each anchor by its tau
        w1_all, w2_all = (tau1_all, tau2_all) if self.individual else (1.0, 1.0)
        coef = {
            "r1": 0.5 / b * w1 * torch.exp(stats.row_c1 - log_norm - log_den1),
            "r2": 0.5 / b * w2 * torch.exp(stats.row_c2 - log_norm - log_den2),
            "q1": 0.5 / big_b * w1_all * torch.exp(stats.col_c1 + log_remote - log_den1_all),
            "q2": 0.5 / big_b * w2_all * torch.exp(stats.col_c2 + log_remote - log_den2_all),
        }
        # the halves of Phi that carry the global tau's gradient: the local one alone gives the exact
        # gradient once the engine averages the ranks; FastCLIP's code lets both carry it
        tau_halves = None
        if tau is not None and tau.requires_grad:
            tau_halves = "both" if self.fastclip_code else "local"
        tau_input = tau if tau_halves else image_features.new_zeros(())
        phi = Surrogate.apply(image_features, text_features, tau_input, ops, stats, coef, tau_halves)
        if self.rgcl_g:
            # tau_d·Phi + rho·tau + tau·1/2·mean(log(u+eps)): its gradient is RGCL-g's (SPEC's L_v3);
            # FastCLIP's code takes log u without eps
            if self.fastclip_code:
                log_u_sum = cached.new_all[local, col("log_u1")] + cached.new_all[local, col("log_u2")]
            else:
                log_u_sum = log_den1 + log_den2
            loss = tau.detach() * phi + self.cfg.rho * tau + tau * 0.5 * log_u_sum.mean()
        else:
            loss = phi
        return LossOutput(loss, {**cached.metrics, "loss/surrogate": float(phi.detach())})

    def _step_individual_tau(self, new_rows, taus, shifts, dsums, log_dens, big_b) -> None:
        """Per-sample tau gradient of tau_i(log(eps+g_i)+rho), estimated with the new u, then one step."""
        col = self.state.column
        log_norm = math.log(big_b - 1)
        for k, (tau, c, sd, log_den) in enumerate(zip(taus, shifts, dsums, log_dens), start=1):
            # d/dtau [tau (log(eps+g) + rho)] = log(eps+g) + rho - (1/(B-1)) sum_j exp(d_ij) d_ij / (eps+g)
            grad = log_den + self.cfg.rho - sd * torch.exp(c - log_norm - log_den)
            v = new_rows[:, col(f"v{k}")] if self.temperature.rule == "individual_adam" else None
            new_tau, m, v = self.temperature.individual_step(
                tau.detach(), grad.detach(), new_rows[:, col(f"m{k}")], v, self.epoch
            )
            new_rows[:, col(f"tau{k}")], new_rows[:, col(f"m{k}")] = new_tau, m
            if v is not None:
                new_rows[:, col(f"v{k}")] = v

    # ---- step hooks and checkpoints ----------------------------------------------------------------

    def on_step_applied(self) -> None:
        self.state.commit()

    def on_step_skipped(self) -> None:
        self.state.discard()

    def save_state(self, folder) -> None:
        self.state.save(folder)

    def load_state(self, folder) -> None:
        self.state.load(folder)


@dataclass
class _CachedPairs:
    """What a step's ``cached_forward`` calls share: every pair's features, temperatures and new state."""

    e1_all: torch.Tensor  # [B, d] every pair's image features (no autograd)
    e2_all: torch.Tensor
    tau1_all: torch.Tensor  # [B] each image anchor's temperature (detached)
    tau2_all: torch.Tensor
    new_all: torch.Tensor  # [B, F] every pair's staged state
    offset: int  # where this rank's pairs start among the B
    micro_batch: int
    stats: Stats | None  # of micro-batch 0, where begin_cached_step computed them already
    metrics: dict[str, float]


def _update_log_u(log_u_old: torch.Tensor, log_g: torch.Tensor, gamma: float) -> torch.Tensor:
    """log of (1-gamma)·u + gamma·g, with SPEC's reset to g for a stored u < 1e-35, inf or NaN."""
    if gamma >= 1.0:
        return log_g
    unset = ~torch.isfinite(log_u_old) | (log_u_old < _LOG_TINY)
    mixed = torch.logaddexp(log_u_old + math.log(1 - gamma), log_g + math.log(gamma))
    return torch.where(unset, log_g, mixed)
