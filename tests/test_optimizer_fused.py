"""On CPU, megatron's AdamW runs torch's fused kernel: the same update as the loop it replaces."""

import torch


def build(fused: bool, **flags):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import seed
    from swift_mcore.runtime.ddp import wrap_model
    from swift_mcore.training import optimizer as opt

    args = resolve(RunArguments.from_flags(num_layers=2, hidden_size=64,
                                                num_attention_heads=4, num_query_groups=2,
                                                seq_length=32, **flags), world_size=1
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


def train(model, optimizer, steps=3):
    """``steps`` optimizer steps on one fixed batch at lr 1e-2; the parameters after them."""
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    for group in groups(optimizer):
        group["lr"] = 1e-2
    for _ in range(steps):
        model[0].zero_grad_buffer()
        optimizer.zero_grad()
        out = model[0](tokens, torch.arange(32).expand(2, -1), None, labels=tokens)
        out.mean().backward()
        model[0].finish_grad_sync()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model[0].named_parameters()}


def test_clipping_runs_inside_the_fused_step(gloo_group, monkeypatch):
    """--clip_grad small enough to clip every step: the fused kernel divides the gradients by
    norm / clip_grad (no separate pass scales them first), and the parameters equal those of
    clipping in a pass of its own (megatron's order) to float rounding. adam_eps 1e-5: Adam's
    update is otherwise blind to a constant gradient scale, so a wrong factor would pass."""
    from swift_mcore.runtime.cpu import cpu_compat

    model, optimizer = build(True, clip_grad=1e-3, adam_eps=1e-5)
    seen = []
    for part in optimizer.chained_optimizers:
        part.optimizer.register_step_pre_hook(
            lambda inner, args, kwargs: seen.append(getattr(inner, "grad_scale", None)))
    start = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    folded = train(model, optimizer)
    assert sum(not torch.equal(start[n], folded[n]) for n in start) == len(start)  # all moved
    assert len(seen) == 3 * len(optimizer.chained_optimizers)
    assert all(s is not None and float(s) > 1.0 for s in seen), seen  # norm / 1e-3
    assert all(getattr(p.optimizer, "grad_scale", None) is None
               for p in optimizer.chained_optimizers)  # dropped after the step

    # clipping in a pass of its own
    monkeypatch.setattr(cpu_compat, "clip_in_step", lambda parameters, coeff: list(parameters))
    model, optimizer = build(True, clip_grad=1e-3, adam_eps=1e-5)
    separate = train(model, optimizer)
    for name, value in separate.items():
        assert float((folded[name] - value).abs().max()) <= 1e-6, name


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


def test_a_checkpoint_that_clipped_apart_resumes_bit_for_bit(tmp_path, gloo_group, monkeypatch):
    """A checkpoint written before the clipping moved into the fused step (its param groups
    without the clip_in_step key) resumes clipping in a pass of its own, as the run that
    wrote it went on: the same losses and gradient norms bit for bit (clipping in the step
    differs in the last bits). A checkpoint with the key keeps clipping in the step."""
    from in_process import train_in_process
    from run_helpers import train_records
    from swift_mcore.runtime.cpu import cpu_compat, fused_adamw

    flags = ["--train_iters", "4", "--clip_grad", "0.5", "--lr", "1e-2", "--min_lr", "1e-2"]
    fuse = fused_adamw.use_fused_adamw

    def as_before(optimizer):  # the fused kernel, clipping apart, no key in the groups
        switched = fuse(optimizer)
        for part in optimizer.chained_optimizers:
            for group in part.optimizer.param_groups:
                group.pop("clip_in_step", None)
        return switched

    before, resumed = tmp_path / "before", tmp_path / "resumed"
    with monkeypatch.context() as patch:
        patch.setattr(cpu_compat, "clip_in_step", lambda parameters, coeff: list(parameters))
        patch.setattr(fused_adamw, "use_fused_adamw", as_before)
        train_in_process(before, *flags, "--save_steps", "2", command="pt")
    train_in_process(resumed, *flags, "--no_save", "--resume",
                     before / "checkpoint" / "iter_0000002", command="pt")
    ref = {r["iteration"]: (r["loss"], r["grad_norm"]) for r in train_records(before)}
    got = {r["iteration"]: (r["loss"], r["grad_norm"]) for r in train_records(resumed)}
    assert sorted(got) == [3, 4] and all(got[i] == ref[i] for i in got), (got, ref)
    assert ref[3][1] > 0.5  # it clipped
