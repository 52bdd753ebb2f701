"""(a) With gamma = 1 and the whole dataset in one batch, u = g, so each surrogate's gradient must equal
float64 autograd of its exact objective (GCL, RGCL, RGCL-g), written out here independently."""

import math

import pytest
import torch
import torch.nn.functional as F
from fastclip_reference import fastclip_v3_rank_loss

from eva_fastclip.losses import build_loss

N, D, EPS, RHO = 12, 8, 1e-14, 6.5


def inner(anchors, others, tau):
    """g_i = 1/(n-1) sum_{j != i} exp((a_i·o_j - a_i·o_i)/tau_i), written out term by term."""
    n = anchors.shape[0]
    rows = []
    for i in range(n):
        terms = [
            torch.exp((anchors[i] @ others[j] - anchors[i] @ others[i]) / tau[i]) for j in range(n) if j != i
        ]
        rows.append(torch.stack(terms).sum() / (n - 1))
    return torch.stack(rows)


def gcl(e1, e2, tau, eps=EPS):  # mean_i 1/2 [log(eps + g1_i) + log(eps + g2_i)]
    taus = tau.expand(N)
    return (0.5 * (torch.log(eps + inner(e1, e2, taus)) + torch.log(eps + inner(e2, e1, taus)))).mean()


def rgcl(e1, e2, tau1, tau2):  # mean_i 1/2 [tau1_i (log(eps+g1_i)+rho) + tau2_i (log(eps+g2_i)+rho)]
    g1, g2 = inner(e1, e2, tau1), inner(e2, e1, tau2)
    return (0.5 * (tau1 * (torch.log(EPS + g1) + RHO) + tau2 * (torch.log(EPS + g2) + RHO))).mean()


def rgcl_g(e1, e2, tau, eps=EPS):  # tau · GCL + rho · tau
    return tau * gcl(e1, e2, tau, eps) + RHO * tau


def unit_features(seed):
    g = torch.Generator().manual_seed(seed)
    e1 = F.normalize(torch.randn(N, D, generator=g, dtype=torch.float64), dim=-1)
    e2 = F.normalize(torch.randn(N, D, generator=g, dtype=torch.float64), dim=-1)
    return e1.requires_grad_(True), e2.requires_grad_(True)


def surrogate_grads(name, e1, e2, theta, **overrides):
    loss_fn = build_loss(name, dataset_size=N, **{"eps": EPS, **overrides})
    out = loss_fn(e1, e2, theta.exp(), torch.arange(N))
    wrt = (e1, e2, theta) if theta.requires_grad else (e1, e2)
    return torch.autograd.grad(out.loss, wrt), loss_fn, out


@pytest.mark.parametrize("name", ["sogclr", "fastclip_v1", "fastclip_v0"])
def test_gcl_variants(name):
    e1, e2 = unit_features(0)
    learnable = name == "fastclip_v0"
    theta = torch.tensor([math.log(1 / 0.07)], dtype=torch.float64, requires_grad=learnable)
    got, _, out = surrogate_grads(name, e1, e2, theta)
    wrt = (e1, e2, theta) if learnable else (e1, e2)
    expected = torch.autograd.grad(gcl(e1, e2, 1 / theta.exp()), wrt)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
    assert out.metrics["loss/objective"] == pytest.approx(gcl(e1, e2, 1 / theta.exp()).item(), rel=1e-9)
    assert out.metrics["loss/surrogate"] == pytest.approx(2.0)  # u = g: every ratio is 1


@pytest.mark.parametrize("eps", [EPS, 0.5])  # 0.5: eps matters in log(u+eps) as it does in log(eps+g)
def test_rgcl_g_v3(eps):
    e1, e2 = unit_features(1)
    theta = torch.tensor([math.log(1 / 0.05)], dtype=torch.float64, requires_grad=True)
    got, _, out = surrogate_grads("fastclip_v3", e1, e2, theta, rho=RHO, eps=eps, tau_gradient="exact")
    expected = torch.autograd.grad(rgcl_g(e1, e2, 1 / theta.exp(), eps), (e1, e2, theta))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
    objective = rgcl_g(e1, e2, 1 / theta.exp(), eps).item()
    assert out.metrics["loss/objective"] == pytest.approx(objective, rel=1e-9)
    assert out.metrics["loss/gcl"] == pytest.approx(gcl(e1, e2, 1 / theta.exp(), eps).item(), rel=1e-9)


@pytest.mark.parametrize("eps", [EPS, 0.5])  # 0.5: FastCLIP's code takes log u, not log(u+eps)
def test_rgcl_g_v3_fastclip_code(eps):
    """tau_gradient=fastclip_code: the gradients of the loss FastCLIP's code back-propagates (its loss.py,
    written out in fastclip_reference.py); the features' gradients are the exact ones either way."""
    e1, e2 = unit_features(1)
    theta = torch.tensor([math.log(1 / 0.05)], dtype=torch.float64, requires_grad=True)
    got, _, _ = surrogate_grads("fastclip_v3", e1, e2, theta, rho=RHO, eps=eps, tau_gradient="fastclip_code")
    reference = fastclip_v3_rank_loss(e1, e2, theta.exp(), rank=0, world=1, rho=RHO, eps=eps)
    expected = torch.autograd.grad(reference, (e1, e2, theta))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
    exact, _, _ = surrogate_grads("fastclip_v3", e1, e2, theta, rho=RHO, eps=eps, tau_gradient="exact")
    for g, e in zip(got[:2], exact[:2]):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
    if eps == EPS:  # log u = log(u+eps) here: theta's gradient is RGCL-g's plus GCL's tau-derivative again
        tau = 1 / theta.exp()
        (twice,) = torch.autograd.grad(tau.detach() * gcl(e1, e2, tau), theta)
        torch.testing.assert_close(got[2], exact[2] + twice, rtol=1e-9, atol=1e-12)
        assert not torch.allclose(got[2], exact[2], rtol=1e-3)


@pytest.mark.parametrize(
    "name, rule",
    [("isogclr", "individual_momentum"), ("isogclr", "individual_adam"), ("fastclip_v2", "individual_adam")],
)
def test_rgcl_individual(name, rule):
    e1, e2 = unit_features(2)
    tau_init = float(
        torch.tensor(0.05, dtype=torch.float32)
    )  # the table stores float32: compare like with like
    theta = torch.tensor([0.0], dtype=torch.float64)  # unused by the individual rules
    # no clamping by the bounds or the gradient clip, so the tau step is linear in the gradient
    got, loss_fn, _ = surrogate_grads(
        name,
        e1,
        e2,
        theta,
        rho=RHO,
        temperature_init=tau_init,
        temperature_lr=1e-4,
        temperature_grad_clip=1e9,
        temperature_rule=rule,
    )
    tau1 = torch.full((N,), tau_init, dtype=torch.float64, requires_grad=True)
    tau2 = torch.full((N,), tau_init, dtype=torch.float64, requires_grad=True)
    objective = rgcl(e1, e2, tau1, tau2)
    expected = torch.autograd.grad(objective, (e1, e2, tau1, tau2))
    for g, e in zip(got, expected[:2]):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)

    # each tau_i steps along its own gradient, d/dtau_i of tau_i (log(eps+g_i)+rho): 2N x the objective's
    # (the objective averages over N pairs and, with the 1/2, over the two directions)
    loss_fn.on_step_applied()
    rows = loss_fn.state.local_rows(torch.arange(N)).double()
    grad1, grad2 = 2 * N * expected[2], 2 * N * expected[3]
    for k, grad in ((1, grad1), (2, grad2)):
        new_tau = rows[:, loss_fn.state.column(f"tau{k}")]
        if rule == "individual_momentum":  # iSogCLR's own rule: m = (1 - momentum)·grad, tau <- tau - lr·m
            want = tau_init - 1e-4 * 0.5 * grad
            tol = dict(rtol=1e-6, atol=1e-9)  # the table stores float32
        else:  # FastCLIP-v2's (and iSogCLR's in FastCLIP) in epoch 0 (betas 0): lr · grad / (|grad| + 1e-8)
            want = tau_init - 1e-4 * grad / (grad.abs() + 1e-8)
            tol = dict(rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(new_tau, want, **tol)
    torch.testing.assert_close(
        rows[:, loss_fn.state.column("log_u1")],
        torch.log(inner(e1, e2, torch.full((N,), tau_init))).detach(),
        rtol=1e-6,
        atol=1e-6,
    )
