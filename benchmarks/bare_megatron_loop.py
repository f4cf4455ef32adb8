"""Baseline: the same GPT model trained by a bare megatron-core loop (no swift-mcore trainer).

Uses megatron's GPTModel, DDP, optimizer and forward/backward schedule directly on random
tokens held in memory, so the only difference to `swift-mcore pt` is the framework around
them (data loading, logging, metrics, checkpoint bookkeeping). Prints one JSON line.

  python benchmarks/bare_megatron_loop.py --iters 30 --warmup 5 [swift-mcore pt flags...]
"""

import argparse
import json
import sys
import time


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    ours, rest = parser.parse_known_args(argv)

    import torch

    from swift_mcore.arguments import padded_vocab_size, parse_args
    from swift_mcore.models.gpt import build_model
    from swift_mcore.runtime import distributed, seed

    args = parse_args(rest)
    args.validate()
    distributed.initialize(args)
    seed.set_seed(args.training.seed)
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    vocab = padded_vocab_size(args.model.vocab_size or 4096, 128, 1)
    model = build_model(args, vocab)[0]
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    t = args.training
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=t.lr, weight_decay=t.weight_decay,
                        clip_grad=t.clip_grad), [model])
    seq, mbs = args.model.seq_length, t.micro_batch_size
    data = torch.randint(0, vocab, (64, mbs, seq + 1))

    def forward_step(iterator, chunk):
        rows = next(iterator)
        output = chunk(rows[:, :-1], torch.arange(seq).expand(mbs, -1), None,
                       labels=rows[:, 1:])

        def loss(out):
            total = out.float().sum()
            return total, torch.tensor(out.numel(), dtype=torch.int), {"lm loss": total}

        return output, loss

    def batches():
        i = 0
        while True:
            yield data[i % len(data)]
            i += 1

    iterator = batches()
    step = get_forward_backward_func()
    times = []
    for it in range(ours.warmup + ours.iters):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        step(forward_step_func=forward_step, data_iterator=iterator, model=[model],
             num_microbatches=args.derived.num_microbatches, seq_length=seq,
             micro_batch_size=mbs, forward_only=False)
        optimizer.step()
        if it >= ours.warmup:
            times.append(time.perf_counter() - start)
    tokens = t.global_batch_size * seq
    result = {"tokens_per_s": tokens * len(times) / sum(times), "iters": len(times)}
    if distributed.is_last_rank():
        print(json.dumps(result), flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
