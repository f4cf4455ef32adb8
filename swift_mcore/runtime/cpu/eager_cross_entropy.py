"""The language-model loss on one tensor-parallel rank, written for eager CPU execution.

megatron-core's ``vocab_parallel_cross_entropy`` is built for logits split over TP ranks:
it takes the row maximum, subtracts it in place, exponentiates in place, sums, divides in
place (each a pass over the whole [tokens, vocab] tensor, which does not fit in cache), and
all-reduces three times; its backward scales the kept softmax in place. On a GPU those
passes are cheap; on CPU they are most of the loss's time. With one TP rank the same
quantity is ``-log_softmax(logits)[target]``, and torch's CPU ``log_softmax`` does the max,
the sum and the write row by row while the row is in cache.

``cross_entropy`` writes log_softmax into the logits' own storage, as megatron writes its
softmax there (so the loss holds one [tokens, vocab] tensor, as megatron's does), and its
backward turns it into ``(softmax - onehot(target)) * grad`` in place. Values equal
megatron's to float rounding, not bit for bit: megatron sums the exponentials with
``torch.sum`` and computes ``log(sum) - (x_t - max)``; torch's log_softmax (the kernel of
``F.cross_entropy``) accumulates each row in vector lanes. Against float64, the loss is
within 2e-6 relative for megatron's and 2e-5 for this one at 151,936 columns
(``tests/test_cpu_compat.py``). What it saves per micro-batch: benchmarks/README.md.

The fast path takes one TP rank, no label smoothing and targets inside the vocabulary;
anything else goes to megatron's own function. ``cpu_compat.py`` installs it
without CUDA.
"""

from __future__ import annotations

import torch


class _LogSoftmaxNll(torch.autograd.Function):
    """loss[s, b] = -log_softmax(logits[s, b, :])[target[s, b]]."""

    @staticmethod
    def forward(ctx, logits, target):
        logits = logits.float()  # megatron upcasts too; a no-op for fp32 logits
        log_probs = torch.log_softmax(logits, dim=-1, out=logits)
        index = target.unsqueeze(-1)
        loss = log_probs.gather(-1, index).squeeze(-1).neg_()
        ctx.save_for_backward(log_probs, index)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        log_probs, index = ctx.saved_tensors
        grad = log_probs.exp_()  # the softmax, in the storage the forward kept
        grad.scatter_add_(-1, index, torch.full(index.shape, -1.0, dtype=grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None


def fast_path_applies(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float,
                      tp_world_size: int) -> bool:
    if tp_world_size != 1 or label_smoothing != 0.0 or logits.dim() != target.dim() + 1:
        return False
    if target.numel() == 0:
        return False
    # megatron gives a target outside the vocabulary a zero logit; gather would raise.
    return int(target.min()) >= 0 and int(target.max()) < logits.shape[-1]


def make_cross_entropy(original):
    """A drop-in for megatron's ``tensor_parallel.vocab_parallel_cross_entropy`` (same
    signature) that takes the fast path where it applies and calls ``original`` elsewhere."""
    from megatron.core import parallel_state

    def cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if not fast_path_applies(vocab_parallel_logits, target, label_smoothing, tp):
            return original(vocab_parallel_logits, target, label_smoothing)
        return _LogSoftmaxNll.apply(vocab_parallel_logits, target)

    cross_entropy._swift_mcore_original = original
    return cross_entropy
