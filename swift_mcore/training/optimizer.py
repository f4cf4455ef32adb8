"""megatron-core's optimizer (Adam with decoupled weight decay) and its LR/WD scheduler."""

from __future__ import annotations

from ..runtime import cpu


def build_optimizer(config, model_chunks):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t = config.training
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=t.bf16,
        fp16=t.fp16,
        params_dtype=_params_dtype(t),
        use_distributed_optimizer=config.parallel.use_distributed_optimizer,
        fp8_recipe=t.fp8_recipe if t.fp8_format else None,
    )
    optimizer = get_megatron_optimizer(optimizer_config, model_chunks,
                                       config_overrides=part_overrides(config, optimizer_config))
    count_expert_gradients_once(optimizer, config)
    cpu.after_optimizer(optimizer, config)
    return optimizer


def count_expert_gradients_once(optimizer, config) -> bool:
    """Which tensors a rank adds to the grad norm is decided by the tensor-parallel group
    they repeat over; megatron (0.16) gives its expert optimizer the attention's TP group.
    With --expert_tensor_parallel_size below --tensor_model_parallel_size (gpt-oss's whole
    experts) a replicated expert tensor (the output projection's bias) is then counted on
    TP rank 0 alone, while the expert norm is summed over the expert-parallel ranks, which
    do not include the other TP ranks: each TP rank clips by another norm and the copies
    that must stay equal drift apart (so a resumed run, reading rank 0's, differs). The
    expert TP group is the one those tensors repeat over. Returns whether it was set."""
    p = config.parallel
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    if etp == p.tensor_model_parallel_size:
        return False
    from megatron.core import parallel_state

    group = parallel_state.get_expert_tensor_parallel_group()
    changed = False
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if any(g.get("is_expert_parallel") for g in part.param_groups):
            part.tp_group = group
            changed = True
    return changed


def part_overrides(config, optimizer_config):
    """megatron's param-group overrides for --vit_lr / --aligner_lr: the tower's (aligner's)
    parameters get their own peak lr, and a minimum scaled as --min_lr is to --lr, on top
    of megatron's standard ones (no weight decay on biases and 1-D weights). None (megatron's
    default, the standard ones alone) without those flags."""
    t = config.training
    if not config.model.vision_config or (t.vit_lr is None and t.aligner_lr is None):
        return None
    from megatron.core.optimizer import ParamKey, get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamWithNamePredicate

    from ..models.vision import part_of

    overrides = get_standard_config_overrides(optimizer_config)
    for part, lr in (("vit", t.vit_lr), ("aligner", t.aligner_lr)):
        if lr is None:
            continue
        minimum = t.min_lr * lr / t.lr if t.lr else min(t.min_lr, lr)
        predicate = ParamWithNamePredicate(
            name=f"{part}_lr", fn=lambda param, name, part=part: part_of(_unwrapped(name)) == part)
        overrides[ParamKey(with_name_predicate=predicate)] = {"max_lr": lr, "min_lr": minimum}
    return overrides


def _unwrapped(name: str) -> str:
    """A parameter's name in the model, without DDP's (and Float16Module's) ``module.``."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def build_scheduler(config, optimizer):
    """Steps are counted in iterations: the scheduler is stepped once per optimizer step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = config.training
    decay_iters = t.lr_decay_iters or t.train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters,
        lr_decay_steps=decay_iters,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.train_iters,
        wd_incr_style="constant",
        # A resumed scheduler continues from its checkpointed state; lr flags must match
        # (the resume check reports them otherwise).
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )


def _params_dtype(t):
    import torch

    return torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
