"""Where a training micro-step's memory goes: bytes saved for backward per module and the
allocator's peak, megatron's GPTModel (as swift-mcore builds it) against HF's Llama.

Each contender (in its own process) builds its model from the same swift-mcore flags and
runs one micro-batch of random tokens forward and backward twice (the first warms up).
The second is measured two ways:

* **bytes saved for backward**, per module: ``torch.autograd.graph.saved_tensors_hooks``
  sees every tensor autograd keeps for the backward pass; a module forward hook stack
  says which module was running (the innermost). A storage is counted once, in full (a
  view keeps its whole storage alive), where it was first saved; parameters are not
  activations and are left out. Modules of the first transformer layer are listed by
  their name inside the layer; the other layers are summed into ``other layers``.
* **the allocator's peak**: ``torch.profiler`` with ``profile_memory`` records every CPU
  allocation and free; the peak of the running sum over the micro-step, above what was
  allocated when it started (the weights; gradients of a previous step are freed first).

The micro-step is the trainer's: megatron returns per-token losses and the trainer sums
them under the loss mask (``Trainer.compute_loss``); HF computes its mean loss inside the
model. No optimizer step (its state is the same for both: Adam's two fp32 moments).

  python benchmarks/activation_memory.py --seq_length 1024 [swift-mcore model flags]
  python benchmarks/activation_memory.py --vocab 151936 --seq_length 512
  python benchmarks/activation_memory.py --tiny                     # smoke test
  python benchmarks/activation_memory.py --contenders swift-mcore-step hf-step \
      --global_batch_size 4          # one whole optimizer step (swift-mcore's Trainer)
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

# bench_common puts the checkout on sys.path
from bench_common import LLAMA, SIZES, child_env, print_child_result

CONTENDERS = ("megatron", "megatron-local", "hf")
# --whole_step: one optimizer step of the real trainers (swift-mcore's Trainer.train_step;
# for HF the Trainer's loop body: micro-batch backward passes, clip_grad_norm_, fused AdamW).
STEP_CONTENDERS = ("swift-mcore-step", "hf-step")
# The 10M model of throughput.py, Llama-shaped, micro-batch 2.
DEFAULT = [*SIZES["10m"], "--micro_batch_size", "2", "--global_batch_size", "2",
           "--seq_length", "512"]
TINY = [*SIZES["tiny"], "--micro_batch_size", "2", "--global_batch_size", "2",
        "--seq_length", "32"]
# The first layer's modules are listed by their name inside the layer.
FIRST_LAYER = {"megatron": "decoder.layers.0.", "hf": "model.layers.0."}
OTHER_LAYERS = {"megatron": "decoder.layers.", "hf": "model.layers."}


class SavedBytes:
    """Bytes of the storages autograd saves for backward, by the module that saved them."""

    def __init__(self, model, kind: str):
        import torch

        self.names = {m: name for name, m in model.named_modules()}
        self.kind = kind
        self.stack = []
        self.bytes = defaultdict(int)
        self.seen = set()
        self.first_layer = []  # (module, shape, storage bytes) of layer 0's saved storages
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._torch = torch

    def where(self) -> str:
        name = next((n for n in reversed(self.stack) if n is not None), None)
        if name is None:
            return "outside the model"
        if name == "":
            return "model (its own forward: the loss)"
        first, layers = FIRST_LAYER[self.kind], OTHER_LAYERS[self.kind]
        if name.startswith(first):
            return "layer 0: " + name[len(first):]
        if name + "." == first:
            return "layer 0: (the layer's own forward)"
        if name.startswith(layers):
            return "other layers"
        return name

    def leave(self):
        self.stack.pop()  # returns None: a forward hook's return value replaces the output

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.seen and key not in self.parameters:
            self.seen.add(key)
            where = self.where()
            self.bytes[where] += storage.nbytes()
            if where.startswith("layer 0"):
                self.first_layer.append((where[len("layer 0: "):], list(tensor.shape),
                                         storage.nbytes()))
        return tensor

    def __enter__(self):
        nn = self._torch.nn.modules.module
        self._hooks = [
            nn.register_module_forward_pre_hook(
                lambda m, args: self.stack.append(self.names.get(m))),
            nn.register_module_forward_hook(lambda m, args, out: self.leave()),
        ]
        self._saved = self._torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._saved.__enter__()
        return self

    def __exit__(self, *exc):
        self._saved.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()


def allocator_peak(step) -> tuple:
    """(peak bytes above the start, bytes still allocated at the end) of ``step()``, from
    the profiler's record of every CPU allocation and free, in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, delta in changes:
        live += delta
        peak = max(peak, live)
    return peak, live


def whole_step(contender, flags, vocab):
    """The allocator's peak over one whole training step (after one warm-up step, so that
    Adam's moments exist), above what was allocated before it."""
    import tempfile

    import torch

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.arguments import parse_args
    from swift_mcore.run_config import resolve

    out = tempfile.mkdtemp(prefix="actmem_")
    vocab_flags = ["--vocab_size", str(vocab)] if vocab != 4096 else []
    args = resolve(parse_args([*flags, *vocab_flags, "--num_workers", "0", "--no_save",
                               "--eval_steps", "0", "--progress_bar", "false",
                               "--tensorboard", "false", "--train_iters", "4", "--lr_warmup_iters", "1",
                               "--output_dir", out]))
    if contender == "swift-mcore-step":
        from swift_mcore.training.trainer import Trainer

        trainer = Trainer(args)
        trainer.setup()
        step = trainer.train_step
        parameters = sum(p.numel() for p in trainer.model[0].parameters())
    else:
        from hf_peer import build_model as hf_model

        model = hf_model(args, vocab, "sdpa")
        model.train()
        t = args.training
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, fused=True)
        accumulation = t.global_batch_size // t.micro_batch_size
        generator = torch.Generator().manual_seed(0)

        def step():
            for _ in range(accumulation):
                tokens = torch.randint(0, vocab, (t.micro_batch_size, args.model.seq_length),
                                       generator=generator)
                (model(input_ids=tokens, labels=tokens).loss / accumulation).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        parameters = sum(p.numel() for p in model.parameters())
    step()
    peak, left = allocator_peak(step)
    mb = 2 ** 20
    # What lives across steps, fp32: weights and Adam's two moments for both; megatron's
    # DDP also keeps its gradient buffer (HF's gradients are freed and counted in the peak).
    persistent = 4 * parameters * (4 if contender == "swift-mcore-step" else 3)
    print(json.dumps({"contender": contender, "vocab": vocab, "parameters": parameters,
                      "seq_length": args.model.seq_length,
                      "peak_MB_above_start": round(peak / mb, 1),
                      "persistent_MB": round(persistent / mb, 1),
                      "peak_MB_with_persistent": round((persistent + peak) / mb, 1),
                      "left_MB_after_step": round(left / mb, 1)}), flush=True)


def child(contender, flags, vocab):
    import torch

    if contender in STEP_CONTENDERS:
        return whole_step(contender, flags, vocab)

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.arguments import parse_args
    from swift_mcore.run_config import resolve

    if contender.startswith("megatron"):
        backend = ["--attention_backend", "local"] if contender == "megatron-local" else []
        args = resolve(parse_args([*flags, *backend])).complete(vocab, None,
                                                                 padded_vocab_size=vocab)
        from swift_mcore.models.gpt import build_model
        from swift_mcore.runtime import distributed, seed

        distributed.initialize(args)
        seed.set_seed(0)
        model = build_model(args)[0]
        kind = "megatron"
        seq, mbs = args.model.seq_length, args.training.micro_batch_size
        position_ids = torch.arange(seq).expand(mbs, -1)
        loss_mask = torch.ones(mbs, seq)

        def forward(tokens):
            out = model(tokens, position_ids, None, labels=tokens)
            return (out.float() * loss_mask).sum() / loss_mask.sum()
    else:
        args = resolve(parse_args(flags))
        from hf_peer import build_model as hf_model

        model = hf_model(args, vocab, "sdpa")
        model.train()
        kind = "hf"
        seq, mbs = args.model.seq_length, args.training.micro_batch_size

        def forward(tokens):
            return model(input_ids=tokens, labels=tokens).loss

    tokens = torch.randint(0, vocab, (mbs, seq), generator=torch.Generator().manual_seed(0))

    def step():
        forward(tokens).backward()
        model.zero_grad(set_to_none=True)

    step()
    with SavedBytes(model, kind) as saved:
        loss = forward(tokens)
    loss.backward()
    model.zero_grad(set_to_none=True)
    del loss
    peak, left = allocator_peak(step)
    mb = 2 ** 20
    print(json.dumps({
        "contender": contender, "attention": getattr(args, "attention", "sdpa"),
        "seq_length": seq, "micro_batch_size": mbs, "vocab": vocab,
        "parameters": sum(p.numel() for p in model.parameters()),
        "saved_MB_total": round(sum(saved.bytes.values()) / mb, 2),
        "saved_MB": {k: round(v / mb, 3) for k, v in sorted(saved.bytes.items())},
        # of which the weights' gradients: 4 bytes per parameter in fp32, alike for both
        "peak_MB_above_weights": round(peak / mb, 1),
        "layer0_storages": [[w, shape, round(n / mb, 3)] for w, shape, n in saved.first_layer],
        "gradients_MB": round(4 * sum(p.numel() for p in model.parameters()) / mb, 1),
        "left_MB_after_step": round(left / mb, 1),
    }), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS),
                        choices=CONTENDERS + STEP_CONTENDERS)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts, rest = parser.parse_known_args()
    flags = [*(TINY if opts.tiny else DEFAULT), *LLAMA, *rest]
    if opts.child:
        return child(opts.child, flags, opts.vocab)
    env = child_env(PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    for contender in opts.contenders:
        print_child_result(contender, [__file__, "--child", contender, "--vocab", str(opts.vocab),
                                       *(["--tiny"] if opts.tiny else []), *rest], env)


if __name__ == "__main__":
    main()
