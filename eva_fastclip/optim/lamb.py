"""LAMB with each parameter tensor's own trust ratio, on any device and under ZeRO 0, 1 or 2 alike.

The update is DeepSpeed's FusedLamb (ops/csrc/lamb/fused_lamb_cuda_kernel.cu) in PyTorch ops. Per parameter
tensor of the model, with ``t`` the step count:

    m <- beta1 m + (1 - beta1) g
    v <- beta2 v + (1 - beta2) g^2
    u  = m / (sqrt(v) + eps) + weight_decay w          (eps_inside_sqrt: m / sqrt(v + eps))
    r  = ||w|| / ||u||, clipped to at most max_coeff, then to at least min_coeff; r = 1 if ||w|| or ||u|| is 0
    w <- w - lr r u sqrt(1 - beta2^t) / (1 - beta1^t)     (without bias_correction: w - lr r u)

**Per tensor under ZeRO.** ZeRO-1/2 hand the optimizer one flat fp32 partition per parameter group and rank
instead of the tensors. FusedLamb takes ``r`` of each flat partition, so its steps change with the number
of ranks (and between ZeRO-0 and ZeRO-1). Here each flat partition is told which tensor fragments it holds
(:func:`attach_zero_partitions`, called after ``deepspeed.initialize``). A step sums ||w||^2 and ||u||^2 of
every fragment into one vector of per-tensor sums, and one all-reduce over the data-parallel group adds
the other ranks' fragments. Every fragment is then scaled by its whole tensor's ``r``, so 1 or K ranks and
ZeRO 0, 1 or 2 take the same steps up to rounding. Without fragments (a plain PyTorch use, ZeRO-0)
every parameter is its own tensor. ``optim.lamb_trust_ratio: per_zero_partition`` keeps DeepSpeed's rule
(to reproduce runs made with it): no fragments, so each flat partition counts as one tensor.

Where this differs from timm's ``Lamb`` and FastCLIP's LAMB: every tensor gets the trust ratio, biases,
norms and the temperature included (theirs skip groups without weight decay) and it is always clipped;
eps is added to the square root of the uncorrected v; ``r`` is taken from the uncorrected moments and the
bias correction only scales the step; the weight decay is part of ``u``, so the trust ratio scales it too.
A group's ``max_coeff`` / ``min_coeff`` are read per group, as FusedLamb reads them: ``max_coeff =
min_coeff = 1`` steps that group like Adam with weight decay inside the update.

The state (``step``, ``exp_avg``, ``exp_avg_sq`` per optimizer parameter) and the group keys are FusedLamb's,
so a checkpoint of either resumes with the other; the step count is kept per optimizer parameter (a flat
partition under ZeRO), as FusedLamb keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from eva_fastclip.optim import lamb_fused_cpu
from eva_fastclip.optim.lamb_passes import Fragment, Slot, apply_updates, multi_tensor, sweep_cpu
from eva_fastclip.optim.step_guard import GuardedStep

__all__ = ["Fragment", "Lamb", "attach_zero_partitions"]


class Lamb(GuardedStep, torch.optim.Optimizer):
    """FusedLamb's update in PyTorch ops, trust ratio per model tensor; FusedLamb's arguments and defaults.

    ``max_grad_norm`` must stay 0: FusedLamb clips only with gradient norms passed to its ``step``, which
    DeepSpeed never does (it clips by ``gradient_clipping`` before the step), so it would fail at once.
    """

    #: how a CPU walks memory: "auto" (``fused`` for a large enough step, else ``sweep``), ``fused``
    #: (optim/lamb_fused_cpu.py), ``sweep`` (optim/lamb_passes.py), or ``multi``: CUDA's multi-tensor passes
    #: (tests hold every way to one result)
    cpu_walk = "auto"

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb has no AMSGrad variant (nor has FusedLamb): set amsgrad=False")
        if max_grad_norm != 0.0:
            raise ValueError(
                f"Lamb max_grad_norm={max_grad_norm}: FusedLamb clips only with gradient norms passed to its "
                "step, which DeepSpeed never passes; clip with DeepSpeed's gradient_clipping and leave it 0"
            )
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"Lamb needs lr, eps and weight_decay >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Lamb betas must lie in [0, 1), got {tuple(betas)}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.register_load_state_dict_pre_hook(_from_timm_lamb)
        self.eps_inside_sqrt = eps_inside_sqrt
        self._last_ratios: tuple[torch.Tensor, torch.Tensor] | None = None  # the last call's, on the device
        self._tables: dict[str, Any] = {}  # _tensor_table's, for the layout it was made for
        # set_fragments: id(flat parameter) -> (the parameter, its fragments by start)
        self._fragments: dict[int, tuple[torch.Tensor, list[Fragment]]] | None = None
        self._num_tensors = 0
        self._reduce_over: Any = None  # the process group whose ranks split tensors between them
        self.last_walk = ""  # how the last step walked memory (cpu_walk's values)

    def set_fragments(
        self,
        fragments: Iterable[tuple[torch.Tensor, Sequence[Fragment]]],
        num_tensors: int,
        process_group: Any = None,
    ) -> None:
        """Step flat parameters per model tensor: each of this optimizer's parameters comes with the
        fragments of the ``num_tensors`` model tensors it holds (tensor numbers agree across ranks). With
        ``process_group`` of more than one rank, a tensor's fragments may lie on several of its ranks: every
        step call all-reduces the per-tensor sums over it, so every rank must call ``step`` equally often
        (DeepSpeed does: once per parameter group). Elements outside every fragment are padding: not stepped.
        """
        own = {id(p) for group in self.param_groups for p in group["params"]}
        table = {}
        for param, frags in fragments:
            if id(param) not in own:
                raise ValueError("Lamb.set_fragments got a tensor that is not one of the optimizer's")
            if not param.is_contiguous():
                raise ValueError("Lamb.set_fragments needs contiguous flat parameters")
            frags = sorted(frags, key=lambda f: f.start)
            end = 0
            for frag in frags:
                if not 0 <= frag.tensor < num_tensors or frag.length <= 0 or frag.start < end:
                    raise ValueError(f"Lamb {frag} overlaps another or names no tensor of {num_tensors}")
                end = frag.start + frag.length
            if end > param.numel():
                raise ValueError(f"a Lamb fragment ends at {end}, past its parameter's {param.numel()}")
            table[id(param)] = (param, frags)
        self._fragments, self._num_tensors = table, num_tensors
        split = process_group is not None and dist.get_world_size(process_group) > 1
        self._reduce_over = process_group if split else None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["max_grad_norm"] > 0:
                raise ValueError(
                    f"a Lamb group has max_grad_norm={group['max_grad_norm']}; it must be 0 (see Lamb)"
                )
        stepped = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not stepped:
            return loss
        go, scale = self._guarded_gradients([p.grad for p, _ in stepped])
        if not go:
            return loss
        if self._fragments is None:  # every parameter is a tensor of its own: tensor k is the k-th stepped
            items = [(p, group, [Fragment(k, 0, p.numel())]) for k, (p, group) in enumerate(stepped)]
            self._step_fragments(items, len(items), grad_scale=scale)
            return loss
        items = []
        for param, group in stepped:
            if id(param) not in self._fragments:
                raise RuntimeError(
                    "Lamb has fragments for flat parameters, but not for one it is asked to step: the "
                    "optimizer's parameters were replaced after attach_zero_partitions; call it again"
                )
            items.append((param, group, self._fragments[id(param)][1]))
        self._step_fragments(items, self._num_tensors, self._reduce_over)
        return loss

    def _guarded_gradients(self, grads: list[torch.Tensor]) -> tuple[bool, torch.Tensor | None]:
        """Under :meth:`guard_gradients` (the model's own tensors: no ZeRO partitions), the non-finite
        guard and the clip (optim/step_guard.py): whether to step, and the clip coefficient (None: none),
        which the step's first pass applies."""
        if self._guard is None:
            return True, None
        if self._fragments is not None:
            raise RuntimeError("Lamb clips whole tensors only: under ZeRO, DeepSpeed's optimizer clips")
        scale = self._guard.inspect(grads)
        self.overflow = not self._guard.finite()  # the step's one wait for the device: it decides the rest
        return not self.overflow, scale

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step call: one per tensor stepped, in order (FusedLamb's method;
        there one per parameter, which is one per flat partition under ZeRO). Reading them waits for the
        device: the step itself never does."""
        if self._last_ratios is None:
            return []
        ratios, stepped = self._last_ratios
        return ratios[stepped].tolist()

    def _step_fragments(
        self,
        items: list[tuple[torch.Tensor, dict[str, Any], list[Fragment]]],
        num_tensors: int,
        reduce_over: Any = None,
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """One step of ``items`` (parameter, group, fragments) in a few passes over all of them
        (a multi-tensor op per pass on CUDA; on a CPU a compiled pass and torch's fused AdamW kernel,
        optim/lamb_fused_cpu.py, or a cache-sized sweep, optim/lamb_passes.py): the moments, ``u`` and
        the squared norms of every fragment's ``w`` and ``u``; those summed per tensor
        (all-reduced over ``reduce_over``, the ranks that hold the fragments of a tensor between them)
        into the trust ratios, one vector; then every fragment moved by ``w += -step_size * r * u``.
        Nothing waits for the device: the ratios stay there (:meth:`get_lamb_coeffs` reads them).
        ``grad_scale``: the clip coefficient, which the first pass applies to the gradients."""
        slots = [self._slot(param, group, frags) for param, group, frags in items]
        device = slots[0].w.device
        walk, updates, squares = self._measure(slots, grad_scale)
        self.last_walk = walk
        index, high, low, stepped = self._tensor_table(items, num_tensors, device)
        # rows: squared norms of w and of u per tensor; float64 so that fragments add up exactly enough
        sums = torch.zeros(2, num_tensors, dtype=torch.float64, device=device)
        sums.index_add_(1, index, squares.to(device))
        if reduce_over is not None:
            dist.all_reduce(sums, group=reduce_over)
        weight_norm, update_norm = sums.sqrt_().unbind(0)
        # clipped as the kernel does: to max_coeff first, then to min_coeff; a NaN ratio stays NaN
        ratio = weight_norm / update_norm
        ratio = torch.where(ratio > high, high, ratio)
        ratio = torch.where(ratio < low, low, ratio)
        ratio = torch.where((weight_norm != 0) & (update_norm != 0), ratio, torch.ones_like(ratio))
        self._last_ratios = (ratio, stepped)  # FusedLamb keeps the last step's coefficients only
        step_sizes = [self._step_size(param, group) for param, group, frags in items for _ in frags]
        if walk == "fused":
            lamb_fused_cpu.move(slots, ratio[index], step_sizes, _as_float(grad_scale))
        else:
            apply_updates(slots, updates, ratio[index], step_sizes, walk == "multi")

    def _measure(self, slots: list[Slot], grad_scale: torch.Tensor | None) -> tuple[str, Any, torch.Tensor]:
        """The first pass, the way this device walks memory best (:attr:`cpu_walk`): the way, the
        updates ``u`` where it writes them (the fused CPU step recomputes them in its kernel), and the
        squared norms of every fragment's ``w`` and ``u``."""
        if slots[0].w.device.type != "cpu" or self.cpu_walk == "multi":
            return "multi", *multi_tensor(slots, self.eps_inside_sqrt, grad_scale)
        scale = _as_float(grad_scale)
        if self.cpu_walk == "fused":  # asked for by name: it runs, or says why not
            reason = lamb_fused_cpu.unusable(slots, self.eps_inside_sqrt)
            if reason is not None:
                raise ValueError(f"Lamb's fused CPU step cannot run: {reason}")
            return "fused", None, lamb_fused_cpu.squared_norms(slots, scale)
        auto = self.cpu_walk == "auto" and lamb_fused_cpu.large_enough(slots)
        if auto and lamb_fused_cpu.unusable(slots, self.eps_inside_sqrt) is None:
            try:
                return "fused", None, lamb_fused_cpu.squared_norms(slots, scale)
            except Exception as error:  # noqa: BLE001  (inductor's many failures: no compiler, a build)
                lamb_fused_cpu.give_up(error)
        return "sweep", *sweep_cpu(slots, self.eps_inside_sqrt, scale)

    def _slot(self, param: torch.Tensor, group: dict[str, Any], frags: list[Fragment]) -> Slot:
        """``param``'s arrays for this step, its step count advanced."""
        if param.grad.is_sparse:
            raise RuntimeError("Lamb does not support sparse gradients")
        state = self._state_of(param)
        state["step"] += 1
        grad = param.grad.to(param.dtype)  # FusedLamb takes half gradients for float weights too
        settings = (*group["betas"], group["eps"], group["weight_decay"])
        return Slot(param.detach(), grad, state["exp_avg"], state["exp_avg_sq"], frags, settings)

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
        elif "step" not in state:
            raise RuntimeError(
                f"Lamb state has keys {sorted(state)} but no per-tensor 'step': it was saved by an "
                "optimizer other than FusedLamb, this Lamb or timm's Lamb, and cannot be continued"
            )
        return state

    def _step_size(self, param: torch.Tensor, group: dict[str, Any]) -> float:
        """-lr, times sqrt(1 - beta2^t) / (1 - beta1^t) with bias correction: the step along ``r u``."""
        step_size = group["lr"]
        if group["bias_correction"]:
            beta1, beta2 = group["betas"]
            step = self.state[param]["step"]
            step_size *= (1.0 - beta2**step) ** 0.5 / (1.0 - beta1**step)
        return -step_size

    def _tensor_table(self, items, num_tensors: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The model tensor of every fragment, each tensor's trust-ratio bounds and the tensors stepped
        (sorted), on the device: made once per layout and bounds and kept, so that no step copies them
        there or finds the stepped ones there (a copy, or a ``unique`` on CUDA, waits for the device)."""
        frag_tensors = tuple(f.tensor for _, _, fs in items for f in fs)
        bounds = tuple((f.tensor, g["max_coeff"], g["min_coeff"]) for _, g, fs in items for f in fs)
        key = (frag_tensors, bounds, num_tensors, device)
        if self._tables.get("key") != key:
            high = torch.full((num_tensors,), float("inf"), dtype=torch.float64)
            low = torch.zeros(num_tensors, dtype=torch.float64)
            for tensor, max_coeff, min_coeff in bounds:
                high[tensor], low[tensor] = max_coeff, min_coeff
            index = torch.tensor(frag_tensors, dtype=torch.long)
            table = (index, high, low, index.unique())
            self._tables = {"key": key, "table": tuple(t.to(device) for t in table)}
        return self._tables["table"]


def _as_float(grad_scale: torch.Tensor | None) -> float | None:
    return None if grad_scale is None else float(grad_scale)


def attach_zero_partitions(optimizer: Lamb, tensors: Sequence[torch.Tensor]) -> bool:
    """After ``deepspeed.initialize``: tell ``optimizer`` which fragments of the model's ``tensors`` (its
    parameters in the order it was built with, the same on every rank) each flat ZeRO partition holds.

    DeepSpeed records them for its universal checkpoints: ZeRO-1/2 and its BF16_Optimizer give every
    trainable tensor ``_hp_mapping``, the address of its fragment in this rank's fp32 partition (None where
    all of it lies on other ranks), and ``_dp_group``. Returns False where DeepSpeed kept whole tensors
    (ZeRO-0, fp32 or fp16/bf16 masters): each is its own tensor already.
    """
    inner = [p for group in optimizer.param_groups for p in group["params"]]
    zero = [(t, p) for t, p in enumerate(tensors) if hasattr(p, "_hp_mapping")]
    if not zero:
        trainable = [tuple(p.shape) for p in tensors if p.requires_grad]
        if [tuple(p.shape) for p in inner] != trainable:
            raise RuntimeError(
                "the optimizer's parameters are neither the model's tensors nor ZeRO partitions with "
                "DeepSpeed's fragment addresses: the per-tensor trust ratio cannot be placed; use "
                'optim.lamb_trust_ratio="per_zero_partition" with this DeepSpeed configuration'
            )
        return False
    holders = {p.untyped_storage().data_ptr(): p for p in inner}
    fragments: dict[int, list[Fragment]] = {id(p): [] for p in inner}
    groups = {id(p._dp_group): p._dp_group for _, p in zero}
    if len(groups) != 1:
        raise RuntimeError("per-tensor LAMB needs one data-parallel group for all parameters (no MoE)")
    for t, param in zero:
        mapping = param._hp_mapping
        if mapping is None:  # all of it on other ranks
            continue
        holder = holders.get(mapping.hp_fragment.untyped_storage().data_ptr())
        address = mapping.hp_fragment_address
        if holder is None or mapping.hp_fragment.storage_offset() - holder.storage_offset() != address.start:
            raise RuntimeError("a ZeRO fragment address points outside the optimizer's flat partitions")
        fragments[id(holder)].append(Fragment(t, address.start, address.numel))
    (group,) = groups.values()
    optimizer.set_fragments([(p, fragments[id(p)]) for p in inner], len(tensors), process_group=group)
    return True


#: Group keys of timm's Lamb (what eva_fastclip used on CPU before this class) that FusedLamb has not.
_TIMM_ONLY_GROUP_KEYS = (
    "step",
    "grad_averaging",
    "trust_clip",
    "always_adapt",
    "caution",
    "decoupled_decay",
    "corrected_weight_decay",
    "max_lr_snapshot",
    "foreach",
)


def _from_timm_lamb(optimizer: Lamb, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Continue a checkpoint whose CPU optimizer was timm's Lamb: its moments are the same running averages,
    but it keeps the step count per group, and ``max_grad_norm=None`` would stop the next step."""
    groups = []
    for group in state_dict["param_groups"]:
        group = dict(group)
        if "step" in group:  # timm's: carry its step count over to every tensor of the group
            step = int(group["step"])
            for param_id in group["params"]:
                if param_id in state_dict["state"]:
                    state_dict["state"][param_id] = {**state_dict["state"][param_id], "step": step}
            for key in _TIMM_ONLY_GROUP_KEYS:
                group.pop(key, None)
            if group.get("max_grad_norm") is None:
                group["max_grad_norm"] = 0.0
            for key in ("max_coeff", "min_coeff"):
                group.setdefault(key, optimizer.defaults[key])
        groups.append(group)
    return {**state_dict, "param_groups": groups}
