"""The Hugging Face peer: the equivalent LlamaForCausalLM trained by transformers' Trainer.

Built from the same swift-mcore flags: the same shape (the parameter count is reported so
the caller can check it against megatron's), the same rows, micro-batch and gradient
accumulation up to the same global batch, fp32 on CPU (bf16 with --bf16 on CUDA), and
AdamW with the same lr, betas, eps, weight decay and clipping. The optimizer is
transformers' default for torch >= 2.8, torch's fused AdamW. Attention is `sdpa`
(transformers' default) unless --hf_attention says `eager`.

Labels: HF shifts labels inside the model, so each row is given as input_ids = labels =
swift-mcore's ``tokens``; it then predicts seq - 1 targets per row where megatron predicts
seq (the same forward and backward work, one loss term fewer).

Child mode, used by throughput.py (prints one JSON line like bare_megatron_loop.py:
tokens/s over the timed steps, each step's seconds, parameters, peak RSS):

  python benchmarks/hf_peer.py --data_file rows.pt --iters 4 --warmup 1 [swift-mcore flags]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time

import torch

import bench_common  # noqa: F401  (puts the checkout on sys.path


class Rows(torch.utils.data.Dataset):
    """Rows of a [N, seq] token tensor as HF causal-LM examples; ``length`` > N repeats
    them (a corpus whose one epoch is that long, for the batch-skipping comparison)."""

    def __init__(self, tokens: torch.Tensor, length: int | None = None):
        self.tokens = tokens
        self.length = length or tokens.shape[0]

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        row = self.tokens[index % self.tokens.shape[0]]
        return {"input_ids": row, "labels": row}


class StreamedRows(torch.utils.data.IterableDataset):
    """The same rows as a stream of ``length`` examples (like a `datasets` streaming
    corpus): a reader can only get to example i by reading the ones before it."""

    def __init__(self, tokens: torch.Tensor, length: int):
        self.tokens = tokens
        self.length = length

    def __iter__(self):
        for index in range(self.length):
            row = self.tokens[index % self.tokens.shape[0]]
            yield {"input_ids": row, "labels": row}


def llama_config(args, vocab_size: int, attention: str = "sdpa"):
    """The LlamaConfig of swift-mcore's model for this resolved run (a RunConfig: the
    defaults that follow from other flags, such as --ffn_hidden_size, are filled)."""
    from transformers import LlamaConfig

    m = args.model
    if not (m.swiglu and m.normalization == "RMSNorm" and m.position_embedding_type == "rope"
            and not m.add_bias_linear and not m.add_qkv_bias and not m.qk_layernorm):
        raise SystemExit("hf_peer: only the Llama shape (SwiGLU, RMSNorm, RoPE, no biases) "
                         "has an HF equivalent here")
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
        max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.norm_epsilon,
        initializer_range=m.init_method_std, attention_dropout=m.attention_dropout,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
        use_cache=False)
    config._attn_implementation = attention
    return config


def build_model(args, vocab_size: int, attention: str = "sdpa"):
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.training.seed)
    return LlamaForCausalLM(llama_config(args, vocab_size, attention))


def training_arguments(args, output_dir: str, max_steps: int, workers: int, **overrides):
    """TrainingArguments matching the swift-mcore flags (batch, optimizer, precision)."""
    from transformers import TrainingArguments

    t = args.training
    cuda = torch.cuda.is_available()
    values = dict(
        output_dir=output_dir, per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.global_batch_size // t.micro_batch_size,
        max_steps=max_steps, learning_rate=t.lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_epsilon=t.adam_eps,
        max_grad_norm=t.clip_grad, lr_scheduler_type="cosine", warmup_steps=1,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=workers, dataloader_pin_memory=cuda, use_cpu=not cuda,
        bf16=cuda and t.bf16, seed=t.seed)
    values.update(overrides)
    return TrainingArguments(**values)


def step_clock():
    """A TrainerCallback that records perf_counter at train begin and at each step's
    start and end (after the optimizer step)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.begin = None
            self.step_begins, self.step_ends = [], []

        def on_train_begin(self, *args, **kwargs):
            self.begin = time.perf_counter()

        def on_step_begin(self, *args, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.step_begins.append(time.perf_counter())

        def on_step_end(self, *args, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.step_ends.append(time.perf_counter())

    return StepClock()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_file", required=True)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--hf_attention", default="sdpa", choices=("sdpa", "eager"))
    ours, rest = parser.parse_known_args(argv)

    from swift_mcore.arguments import parse_args
    from swift_mcore.run_config import resolve

    args = resolve(parse_args(rest))
    from transformers import Trainer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    rows = torch.load(ours.data_file, weights_only=True)
    model = build_model(args, rows["vocab_size"], ours.hf_attention)
    clock = step_clock()
    with tempfile.TemporaryDirectory(prefix="hf_peer_") as out:
        trainer = Trainer(
            model=model, train_dataset=Rows(rows["tokens"]), callbacks=[clock],
            args=training_arguments(args, out, ours.warmup + ours.iters,
                                    args.data.num_workers))
        trainer.train()
    marks = [clock.begin] + clock.step_ends
    steps = [b - a for a, b in zip(marks, marks[1:])][ours.warmup:]
    tokens = args.training.global_batch_size * args.model.seq_length
    print(json.dumps({
        "tokens_per_s": tokens * len(steps) / sum(steps), "iters": len(steps),
        "step_s": [round(x, 4) for x in steps],
        "parameters": sum(p.numel() for p in model.parameters()),
        "attention": ours.hf_attention, "torch_threads": torch.get_num_threads(),
        "rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
