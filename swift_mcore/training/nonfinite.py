"""A non-finite loss or gradient norm, found before the optimizer applies the update.

``NonFiniteGuard.step(optimizer, loss, iteration)`` is megatron-core's
``ChainedOptimizer.step`` (0.16: prepare the gradients, their global norm, clip, step) with
one check between the norm and the update: if the loss (known on the last pipeline stage)
or the gradient norm is nan or inf on any rank, every rank learns it from one all-reduce,
and the update is not applied anywhere. Then, by ``--nonfinite_policy``:

- ``stop`` (default): NonFiniteError on every rank. The parameters, the optimizer state and
  the scheduler are the last good step's; the loop ends before any save, so no checkpoint
  holding nan or inf is written and the tracker still names the newest good one.
- ``skip``: the gradients are dropped (zeroed by the next step), the parameters, optimizer
  state and learning rate stay, the iteration counts as skipped (its samples are consumed,
  ``TrainState.skipped_train_samples``, ``skipped`` in the log) and a warning is printed.
  More than ``--nonfinite_skip_limit`` skipped steps in a row stop the run as ``stop`` does.

megatron's own checks do not fit here: DDP's ``check_for_nan_in_grad`` checks each rank's
local gradients before the all-reduce and raises on that rank only (the others wait in the
collective; on CPU it fails on ``torch.cuda.current_device()``), and it cannot skip; the
fp32 optimizer's step never reports a non-finite norm (with ``clip_grad`` nan propagates
into the weights). With fp16, megatron's loss scaler finds inf/nan gradients first and
skips the step itself (lowering the scale), as in Megatron-LM; that is not an error.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from ..errors import NonFiniteError
from ..runtime import collectives

POLICIES = ("stop", "skip")
_KINDS = {0: "finite", 1: "nan", 2: "inf", 3: "-inf"}


def kind(value: Optional[float]) -> int:
    """0 finite (or unknown on this rank), 1 nan, 2 inf, 3 -inf."""
    if value is None or math.isfinite(value):
        return 0
    if math.isnan(value):
        return 1
    return 2 if value > 0 else 3


def agree(loss: Optional[float], grad_norm: Optional[float]) -> Tuple[int, int]:
    """(loss kind, gradient-norm kind), the same on every rank: the loss is known on the last
    pipeline stage only, and a rank's view of the norm must not decide alone."""
    flags = collectives.all_reduce(torch.tensor([kind(loss), kind(grad_norm)], dtype=torch.int),
                                   op=dist.ReduceOp.MAX)
    loss_kind, norm_kind = flags.tolist()
    return loss_kind, norm_kind


def describe(loss_kind: int, norm_kind: int) -> str:
    """'the loss is nan (gradient norm inf)', 'the gradient norm is inf (the loss is finite)'."""
    if loss_kind:
        return f"the loss is {_KINDS[loss_kind]} (gradient norm {_KINDS[norm_kind]})"
    return f"the gradient norm is {_KINDS[norm_kind]} (the loss is finite)"


class NonFiniteGuard:
    """Per run: the policy, the skip limit and the count of consecutive skipped steps."""

    def __init__(self, policy: str = "stop", skip_limit: int = 10,
                 newest_checkpoint: Callable[[], str] = lambda: "",
                 log: Callable[[str], None] = print, lower: str = "--lr"):
        """``lower``: the flags whose smaller value the stop message suggests."""
        if policy not in POLICIES:
            raise ValueError(f"nonfinite policy {policy!r}; one of {POLICIES}")
        self.lower = lower
        self.policy, self.skip_limit = policy, skip_limit
        self.newest_checkpoint, self.log = newest_checkpoint, log
        self.consecutive_skips = 0

    @classmethod
    def for_config(cls, config, log: Callable[[str], None]) -> "NonFiniteGuard":
        t = config.training
        # the preference losses' gradients scale with --beta (its temperature): a huge one
        # overflows them whatever the learning rate
        rlhf = getattr(config, "rlhf", None)
        beta = rlhf is not None and rlhf.rlhf_type != "rm"
        return cls(t.nonfinite_policy, t.nonfinite_skip_limit,
                   newest_checkpoint=lambda: newest_checkpoint_text(config), log=log,
                   lower=f"--lr or --beta {rlhf.beta:g}" if beta else "--lr")

    @torch.no_grad()
    def step(self, optimizer, loss: Optional[float], iteration: int
             ) -> Tuple[bool, Optional[float]]:
        """(update applied, gradient norm). Collective: every rank calls it each iteration
        with its loss (None off the last pipeline stage)."""
        if optimizer.prepare_grads():
            return False, None  # fp16: the loss scaler found inf/nan and lowers the scale
        grad_norm = optimizer.get_grad_norm()
        loss_kind, norm_kind = agree(loss, grad_norm)
        if loss_kind or norm_kind:
            self.refuse(iteration, describe(loss_kind, norm_kind))
            return False, grad_norm
        self.consecutive_skips = 0
        clip(optimizer, grad_norm)
        return optimizer.step_with_ready_grads(), grad_norm

    def refuse(self, iteration: int, what: str) -> None:
        """The step is not applied: raise (stop, or too many skips in a row) or warn."""
        self.consecutive_skips += 1
        if self.policy == "stop":
            raise NonFiniteError(
                f"iteration {iteration}: {what}; stopped before the optimizer step, so no "
                f"checkpoint holding nan or inf was written. {self.newest_checkpoint()}"
                f"Lower {self.lower} (or check the data), or pass --nonfinite_policy skip "
                f"to skip such steps")
        if self.consecutive_skips > self.skip_limit:
            raise NonFiniteError(
                f"iteration {iteration}: {what}; {self.consecutive_skips} non-finite steps "
                f"in a row exceed --nonfinite_skip_limit {self.skip_limit}: stopped before "
                f"the optimizer step (no skipped step was applied or saved). "
                f"{self.newest_checkpoint()}".rstrip())
        self.log(f"warning: iteration {iteration}: {what}; step skipped "
                 f"(--nonfinite_policy skip): parameters, optimizer state and learning rate "
                 f"unchanged, its samples consumed ({self.consecutive_skips} in a row, at most "
                 f"{self.skip_limit})")


def clip(optimizer, grad_norm: float) -> None:
    """Clip every part's gradients by the global norm, as ChainedOptimizer.step does."""
    from megatron.core.optimizer import optimizer as mcore_optimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(part, "is_stub_optimizer", False):
            continue
        params = part.get_parameters()
        if params and part.config.clip_grad > 0.0:
            # Looked up at call time: the CPU port (runtime/cpu) replaces it on CPU.
            mcore_optimizer.clip_grad_by_total_norm_fp32(
                params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def newest_checkpoint_text(config) -> str:
    """One sentence: which checkpoint ``--resume`` takes now."""
    from ..checkpointing.folders import checkpoint_root, iter_dir_name, read_latest

    if config.checkpoint.no_save:
        return "No checkpoint is written (--no_save). "
    root = checkpoint_root(config)
    iteration, _ = read_latest(root)
    if iteration is None:
        return "No checkpoint was written yet. "
    return (f"The newest good checkpoint, {root}/{iter_dir_name(iteration)}, is what "
            f"--resume takes. ")
