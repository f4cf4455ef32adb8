"""On CPU, megatron's AdamW runs torch's fused kernel: the same update as the loop it replaces."""

import torch


def build(fused: bool):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import seed
    from swift_mcore.runtime.ddp import wrap_model
    from swift_mcore.training import optimizer as opt

    args = resolve(RunArguments.from_flags(num_layers=2, hidden_size=64,
                                                num_attention_heads=4, num_query_groups=2,
                                                seq_length=32), world_size=1
                   ).complete(256, None, padded_vocab_size=256)
    seed.set_seed(0)
    model = wrap_model(args, build_model(args))
    if fused:
        optimizer = opt.build_optimizer(args, model)
    else:  # megatron's own choice, untouched
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        t = args.training
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
            clip_grad=t.clip_grad, params_dtype=torch.float32), model)
    return model, optimizer


def groups(optimizer):
    return [g for part in optimizer.chained_optimizers for g in part.optimizer.param_groups]


def test_build_optimizer_uses_the_fused_kernel_on_cpu(gloo_group):
    _, optimizer = build(fused=True)
    assert groups(optimizer) and all(g["fused"] for g in groups(optimizer))
    _, stock = build(fused=False)
    assert not any(g["fused"] for g in groups(stock))


def test_fused_steps_match_megatrons_loop(gloo_group):
    runs = {}
    for fused in (False, True):
        model, optimizer = build(fused)
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
        for group in groups(optimizer):
            group["lr"] = 1e-2  # steps large enough that a wrong update shows above 1e-5
        for _ in range(3):
            model[0].zero_grad_buffer()
            optimizer.zero_grad()
            out = model[0](tokens, torch.arange(32).expand(2, -1), None, labels=tokens)
            out.mean().backward()
            model[0].finish_grad_sync()
            optimizer.step()
        runs[fused] = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    for name, value in runs[False].items():
        assert float((runs[True][name] - value).abs().max()) <= 1e-5, name


def test_a_cuda_config_leaves_megatrons_optimizer_as_it_built_it(gloo_group):
    """RunConfig.cuda decides, not the machine: with cuda=True the CPU port does not touch
    the optimizer (on a GPU megatron's fused Adam is TE's or apex's)."""
    import dataclasses

    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime.ddp import wrap_model
    from swift_mcore.training import optimizer as opt

    args = resolve(RunArguments.from_flags(num_layers=2, hidden_size=64,
                                                num_attention_heads=4, num_query_groups=2,
                                                seq_length=32), world_size=1
                   ).complete(256, None, padded_vocab_size=256)
    model = wrap_model(args, build_model(args))
    optimizer = opt.build_optimizer(dataclasses.replace(args, cuda=True), model)
    assert groups(optimizer) and not any(g["fused"] for g in groups(optimizer))
