"""megatron's optimizer step on CPU: its stock torch AdamW loop against the fused kernel.

Without CUDA megatron-core falls back to ``torch.optim.AdamW`` with default flags, a
per-parameter loop on CPU; the CPU port (``swift_mcore/runtime/cpu/fused_adamw.py``) switches
it to torch's fused kernel (``use_fused_adamw``). This script builds the model (default: the 97M
model of checkpoint_io.py and throughput.py's "100m"), fills its gradients with one real
forward/backward, and times ``optimizer.step()`` (megatron's: gradient copy, norm,
clipping, then the Adam update) on the same optimizer and state, switching the param
groups between the two kernels on alternate steps, so drifting load on a shared machine
hits both alike. Prints one JSON line with the median and best step of each.

  python benchmarks/optimizer_step.py                       # 97M parameters, 10 steps each
  python benchmarks/optimizer_step.py --tiny --steps 2      # smoke test
"""

import argparse
import json
import statistics
import time

from bench_common import LLAMA_SETTINGS, SHAPES  # puts the checkout on sys.path

BIG = SHAPES["100m"]
TINY = SHAPES["tiny"]
LLAMA = LLAMA_SETTINGS


def set_kernel(optimizer, fused: bool):
    from swift_mcore.runtime.cpu.fused_adamw import use_fused_adamw

    if fused:
        return use_fused_adamw(optimizer)
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in part.optimizer.param_groups:
            group["fused"], group["foreach"] = None, None  # torch's defaults: the loop on CPU
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per kernel")
    parser.add_argument("--tiny", action="store_true")
    opts = parser.parse_args()

    import torch

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model, count_parameters
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import distributed, seed
    from swift_mcore.runtime.ddp import wrap_model
    from swift_mcore.training.optimizer import build_optimizer

    vocab = 4096
    args = resolve(RunArguments.from_flags(**(TINY if opts.tiny else BIG), **LLAMA,
                                                seq_length=32, micro_batch_size=1,
                                                global_batch_size=1)
                   ).complete(vocab, None, padded_vocab_size=vocab)
    distributed.initialize(args)
    seed.set_seed(0)
    model = wrap_model(args, build_model(args))
    optimizer = build_optimizer(args, model)
    tokens = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    model[0].zero_grad_buffer()
    out = model[0](tokens, torch.arange(32).expand(1, -1), None, labels=tokens)
    out.mean().backward()
    model[0].finish_grad_sync()

    inner = [part.optimizer for part in getattr(optimizer, "chained_optimizers", [optimizer])]
    times = {"loop": [], "fused": []}
    inner_times = {"loop": [], "fused": []}
    for step in range(2 * (opts.steps + 1)):
        kernel = ("loop", "fused")[step % 2]
        set_kernel(optimizer, kernel == "fused")
        # Megatron's step ends in the torch optimizer's step: time that part on its own too.
        spent = []
        originals = [opt.step for opt in inner]
        for opt, original in zip(inner, originals):
            def timed(*a, _original=original, **k):
                start = time.perf_counter()
                try:
                    return _original(*a, **k)
                finally:
                    spent.append(time.perf_counter() - start)
            opt.step = timed
        start = time.perf_counter()
        optimizer.step()
        total = time.perf_counter() - start
        for opt in inner:
            del opt.step  # the bound method again
        if step >= 2:  # the first step of each kernel initialises state and threads
            times[kernel].append(total)
            inner_times[kernel].append(sum(spent))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "parameters_M": round(count_parameters(model) / 1e6, 2), "steps": opts.steps,
        "torch_threads": torch.get_num_threads(),
        "step_s_median": {k: round(v, 4) for k, v in med.items()},
        "step_s_best": {k: round(min(v), 4) for k, v in times.items()},
        "adamw_s_median": {k: round(statistics.median(v), 4) for k, v in inner_times.items()},
        "loop_over_fused": round(med["loop"] / med["fused"], 2),
        "step_s_runs": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }), flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
