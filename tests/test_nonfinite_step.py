"""The optimizer step's non-finite check (swift_mcore/training/nonfinite.py), in process: the
guarded step is megatron's step when everything is finite; a nan step changes nothing and
stops (stop) or is skipped up to the limit (skip). The multi-rank runs, the CLI's exit code
and the checkpoints are in tests/checkpointing/test_resume_nonfinite.py."""

import math

import pytest
import torch

from swift_mcore.errors import NonFiniteError
from swift_mcore.training.nonfinite import NonFiniteGuard, agree, describe, kind


def build(clip_grad=0.05):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import seed
    from swift_mcore.runtime.ddp import wrap_model
    from swift_mcore.training.optimizer import build_optimizer

    args = RunArguments.from_flags(num_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_query_groups=2, seq_length=32, lr=1e-2,
                                        clip_grad=clip_grad, lr_warmup_iters=0)
    config = resolve(args, world_size=1).complete(256, None)
    seed.set_seed(0)
    model = wrap_model(config, build_model(config))
    return model, build_optimizer(config, model)


def backward(model, optimizer, step, poison=1.0):
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step))
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    out = model[0](tokens, torch.arange(32).expand(2, -1), None, labels=tokens)
    (out.mean() * poison).backward()
    model[0].finish_grad_sync()


def snapshot(model, optimizer):
    params = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for part in optimizer.chained_optimizers for s in part.optimizer.state.values()]
    return params, state


def same(a, b):
    (pa, sa), (pb, sb) = a, b
    return (pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
            and len(sa) == len(sb) and all(
                x.keys() == y.keys() and all(torch.equal(torch.as_tensor(x[k]),
                                                         torch.as_tensor(y[k])) for k in x)
                for x, y in zip(sa, sb)))


@pytest.mark.parametrize("clip_grad", [0.05, 0.0])
def test_the_guarded_step_is_megatrons_step(gloo_group, clip_grad):
    """Bit for bit, with clipping active (a small clip_grad) and off; the norm is reported
    either way."""
    runs = []
    for guarded in (False, True):
        model, optimizer = build(clip_grad)
        guard, norms = NonFiniteGuard(), []
        for step in range(3):
            backward(model, optimizer, step)
            if guarded:
                ok, norm = guard.step(optimizer, loss=5.0, iteration=step + 1)
            else:
                ok, norm, _ = optimizer.step()
            assert ok
            norms.append(norm)
        runs.append((snapshot(model, optimizer), norms))
    assert same(runs[0][0], runs[1][0])
    if clip_grad:
        assert runs[0][1] == runs[1][1] and runs[1][1][0] > clip_grad  # it did clip
    assert all(n is not None and math.isfinite(n) for n in runs[1][1])


def test_a_nan_step_changes_nothing_stops_or_is_skipped_up_to_the_limit(gloo_group):
    model, optimizer = build()
    backward(model, optimizer, 0)
    NonFiniteGuard().step(optimizer, loss=5.0, iteration=1)  # Adam state exists now
    before = snapshot(model, optimizer)

    backward(model, optimizer, 1, poison=float("nan"))
    with pytest.raises(NonFiniteError, match=r"^iteration 2: the gradient norm is nan \(the "
                                             r"loss is finite\); stopped before the "
                                             r"optimizer step"):
        NonFiniteGuard("stop").step(optimizer, loss=5.0, iteration=2)
    assert same(before, snapshot(model, optimizer))

    lines = []
    skip = NonFiniteGuard("skip", skip_limit=2, log=lines.append)
    for it in (2, 3):
        backward(model, optimizer, it, poison=float("nan"))
        assert skip.step(optimizer, loss=float("nan"), iteration=it)[0] is False
    assert same(before, snapshot(model, optimizer))
    assert lines[1].startswith("warning: iteration 3: the loss is nan (gradient norm nan); "
                               "step skipped (--nonfinite_policy skip)")
    backward(model, optimizer, 4, poison=float("inf"))
    with pytest.raises(NonFiniteError, match=r"3 non-finite steps in a row exceed "
                                             r"--nonfinite_skip_limit 2"):
        skip.step(optimizer, loss=5.0, iteration=4)
    # A finite step resets the count (and is applied).
    skip.consecutive_skips = 2
    backward(model, optimizer, 5)
    assert skip.step(optimizer, loss=5.0, iteration=5)[0] is True
    assert skip.consecutive_skips == 0
    assert not same(before, snapshot(model, optimizer))


def test_kinds_and_descriptions():
    assert [kind(v) for v in (None, 1.0, float("nan"), float("inf"), -float("inf"))] == \
        [0, 0, 1, 2, 3]
    assert describe(1, 2) == "the loss is nan (gradient norm inf)"
    assert describe(0, 3) == "the gradient norm is -inf (the loss is finite)"
    assert agree(None, 2.0) == (0, 0)
