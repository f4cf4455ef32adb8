"""Baseline: the same GPT model trained by a bare megatron-core loop (no swift-mcore trainer).

Uses megatron's GPTModel, DDP, optimizer and forward/backward schedule directly on tokens
held in memory, so the only difference to `swift-mcore pt` is the framework around them
(data loading, logging, metrics, checkpoint bookkeeping). The tokens are random, or with
``--data_file`` the rows another benchmark saved (``{"tokens", "labels"}``, [rows, seq]
int64, read in order, ``mbs`` rows per micro-batch). Prints one JSON line: tokens/s over
the timed iterations, each iteration's seconds and the process's peak RSS.

  python benchmarks/bare_megatron_loop.py --iters 30 --warmup 5 [swift-mcore pt flags...]
"""

import argparse
import json
import resource
import sys
import time


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--data_file", help="rows of tokens/labels to train on (torch.save)")
    ours, rest = parser.parse_known_args(argv)

    import torch

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.arguments import parse_args
    from swift_mcore.models.gpt import build_model, count_parameters
    from swift_mcore.run_config import padded_vocab, resolve
    from swift_mcore.runtime import distributed, seed

    args = resolve(parse_args(rest))
    distributed.initialize(args)
    seed.set_seed(args.training.seed)
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # No tokenizer here: the model's vocabulary is --vocab_size, else the default tokenizer's.
    tokens_vocab = args.model.vocab_size or 4096
    vocab = padded_vocab(tokens_vocab, 128, 1)
    args = args.complete(tokens_vocab, None, padded_vocab_size=vocab)
    model = build_model(args)[0]
    parameters = count_parameters([model])
    # As swift_mcore/runtime/ddp.py: bf16 gradients are reduced in fp32.
    model = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=args.training.bf16),
        model)
    model.config.finalize_model_grads_func = finalize_model_grads
    t = args.training
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=t.lr, weight_decay=t.weight_decay,
                        clip_grad=t.clip_grad, bf16=t.bf16,
                        params_dtype=torch.bfloat16 if t.bf16 else torch.float32), [model])
    seq, mbs = args.model.seq_length, t.micro_batch_size
    cuda = torch.cuda.is_available()
    if ours.data_file:
        rows = torch.load(ours.data_file, weights_only=True)
        tokens, labels = rows["tokens"], rows["labels"]
    else:
        tokens = torch.randint(0, vocab, (64 * mbs, seq))
        labels = torch.randint(0, vocab, (64 * mbs, seq))
    if cuda:
        tokens, labels = tokens.cuda(), labels.cuda()
    position_ids = torch.arange(seq, device=tokens.device).expand(mbs, -1)

    def forward_step(iterator, chunk):
        batch_tokens, batch_labels = next(iterator)
        output = chunk(batch_tokens, position_ids, None, labels=batch_labels)

        def loss(out):
            total = out.float().sum()
            return total, torch.tensor(out.numel(), dtype=torch.int, device=out.device), \
                {"lm loss": total}

        return output, loss

    def batches():
        i, n = 0, tokens.shape[0] // mbs
        while True:
            j = (i % n) * mbs
            yield tokens[j:j + mbs], labels[j:j + mbs]
            i += 1

    iterator = batches()
    step = get_forward_backward_func()
    times = []
    for it in range(ours.warmup + ours.iters):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        step(forward_step_func=forward_step, data_iterator=iterator, model=[model],
             num_microbatches=args.world.num_microbatches, seq_length=seq,
             micro_batch_size=mbs, forward_only=False)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if it >= ours.warmup:
            times.append(time.perf_counter() - start)
    tokens_per_step = t.global_batch_size * seq
    result = {"tokens_per_s": tokens_per_step * len(times) / sum(times), "iters": len(times),
              "step_s": [round(x, 4) for x in times], "parameters": parameters,
              "torch_threads": torch.get_num_threads(),
              "rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if distributed.is_last_rank():
        print(json.dumps(result), flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
