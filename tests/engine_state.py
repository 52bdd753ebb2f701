"""The whole optimizer state of a DeepSpeed engine, gathered from the ZeRO partitions, for tests that compare
runs: each trained tensor's fp32 master, LAMB's / Adam's moments and the module's own copy."""

import torch


def full_state(engine) -> dict[str, tuple[torch.Tensor, ...]]:
    """name -> (fp32 master weight, exp_avg, exp_avg_sq, the module's weight), whole, in float64."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    masters = {}
    if isinstance(engine.optimizer, FP16_UnfusedOptimizer):
        for low, high in zip(engine.optimizer.fp16_groups, engine.optimizer.fp32_groups):
            masters.update(zip(map(id, low), high))
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:  # not the optimizer's (a fixed temperature)
            continue
        if hasattr(p, "_hp_mapping"):
            w, m, v = (gather_fragments(engine, p, key) for key in (None, "exp_avg", "exp_avg_sq"))
        else:
            master = masters.get(id(p), p)
            state = engine.basic_optimizer.state[master]
            w, m, v = master, state["exp_avg"], state["exp_avg_sq"]
        out[name] = tuple(x.detach().double().clone().view(p.shape) for x in (w, m, v, p))
    return out


def gather_fragments(engine, p: torch.Tensor, key: str | None) -> torch.Tensor:
    """The whole of ZeRO tensor ``p``'s master (``key`` None) or optimizer state, from every rank's flat
    partition at the addresses DeepSpeed records (its own ``safe_get_full_optimizer_state`` finds the state
    of the first parameter group only: it links the others before they have any)."""
    import torch.distributed as dist

    full = torch.zeros(p.numel())
    mapping = p._hp_mapping
    if mapping is not None:
        holder = engine.basic_optimizer.param_groups[mapping.param_group_index]["params"][0]
        source = holder if key is None else engine.basic_optimizer.state[holder][key]
        hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
        full.narrow(0, lp.start, lp.numel).copy_(source.detach().narrow(0, hp.start, hp.numel))
    dist.all_reduce(full, group=p._dp_group)
    return full
