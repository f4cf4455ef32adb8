"""LoRA-DPO's implicit reference (the base, adapters switched off) is the base model: one
step equals DPO of the same LoRA policy with the base folder as --ref_model."""

import pytest
import torch

from rlhf_helpers import ROWS, run_flags


def lora_trainer(folder, data, out, *extra):
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.run_config import resolve
    from swift_mcore.training.rlhf_trainer import DpoTrainer

    argv = ["--model", str(folder), "--dataset", str(data), "--output_dir", str(out),
            "--train_iters", "1", "--no_save", "--tuner_type", "lora", "--lora_rank", "4",
            *run_flags(*extra)]
    trainer = DpoTrainer(resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments),
                                 world_size=1))
    trainer.setup()
    return trainer


def one_step(trainer):
    """Loss and adapter gradients of one step, after setting every adapter's B to the same
    nonzero values (a fresh B is zero, which would make policy and reference agree)."""
    from swift_mcore.runtime import run_lock

    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in sorted(trainer.model[0].named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    batch = trainer.train_ds.collate([trainer.train_ds[i] for i in range(len(ROWS))])
    losses = trainer.forward_backward(iter([batch]), forward_only=False)
    loss_sum, pairs, _ = trainer.reduce_losses(losses)
    metrics = trainer.preference_metrics(losses)
    grads = {n: p.main_grad.clone() for n, p in trainer.model[0].named_parameters()
             if p.requires_grad}
    trainer.writer.close()
    trainer.watchdog.close()
    run_lock.release(trainer.config.logging.output_dir)
    return loss_sum / pairs, grads, trainer.reference, metrics


def test_lora_implicit_reference_equals_the_base_as_ref_model(tiny_hf, tmp_path, gloo_group):
    folder, data = tiny_hf
    implicit, grads, no_copy, metrics = one_step(lora_trainer(folder, data, tmp_path / "a"))
    explicit, ref_grads, copy, _ = one_step(lora_trainer(folder, data, tmp_path / "b",
                                                         "--ref_model", str(folder)))
    assert no_copy is None and copy is not None  # the implicit reference is no second model
    # the adapters move the policy away from its reference
    assert abs(metrics["rewards/chosen"]) > 1e-2 and abs(metrics["rewards/rejected"]) > 1e-2
    assert implicit == pytest.approx(explicit, abs=1e-6)
    assert sorted(grads) == sorted(ref_grads) and grads
    for name in grads:
        assert (grads[name] - ref_grads[name]).abs().max().item() <= 1e-6, name
