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
    optimizer = get_megatron_optimizer(optimizer_config, model_chunks)
    cpu.after_optimizer(optimizer, config)
    return optimizer


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
