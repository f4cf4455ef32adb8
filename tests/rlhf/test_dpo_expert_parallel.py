"""DPO on a mixture-of-experts policy: expert parallelism (EP=2) gives the one-rank losses,
gradient norms and metrics, and the reference (a frozen copy) has no gradients and no
optimizer state, its experts included, on every rank."""

import json
import subprocess
import sys
import textwrap

import pytest

import hf_helpers as H
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env
from test_moe_families import make_moe

METRICS = ("loss", "grad_norm", "load_balancing_loss", "rewards/chosen", "rewards/rejected",
           "rewards/margins", "logps/chosen", "logps/rejected")

# Trains as `swift-mcore rlhf` does on this rank, then writes what the reference holds.
DRIVER = textwrap.dedent('''
    import json, sys
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.run_config import resolve
    from swift_mcore.training.rlhf_trainer import DpoTrainer
    import torch.distributed as dist

    config = resolve(parse_args(sys.argv[1:], prog="swift-mcore rlhf", cls=RlhfArguments),
                     world_size=int(__import__("os").environ.get("WORLD_SIZE", "1")))
    trainer = DpoTrainer(config)
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    reference = [(name, p) for chunk in trainer.reference for name, p in chunk.named_parameters()]
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{config.logging.output_dir}/reference_rank{rank}.json", "w") as fh:
        json.dump({
            "parameters": len(reference),
            "experts": sum("experts" in name for name, _ in reference),
            "trainable": [n for n, p in reference if p.requires_grad],
            "with_grad": [n for n, p in reference
                          if p.grad is not None or getattr(p, "main_grad", None) is not None],
            "optimized": [n for n, p in reference if id(p) in optimized],
            "policy_optimized": len(optimized),
        }, fh)
''')


def curve(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows if r.get("split") == "train"}


def dpo(out, driver, folder, data, nproc, *flags):
    command = [sys.executable, str(driver)]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={H.free_port()}", str(driver)]
    proc = subprocess.run([*command, "--model", str(folder), "--dataset", str(data),
                           "--train_iters", "3", "--no_save", "--output_dir", str(out),
                           *run_flags("--micro_batch_size", "2", *flags)],
                          capture_output=True, text=True, timeout=400, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"reference_rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.benchmark
def test_expert_parallel_gives_the_one_rank_run_and_the_reference_stays_frozen(tiny_hf,
                                                                               tmp_path):
    folder = tmp_path / "moe"
    make_moe(folder, "qwen3_moe")  # four experts, top-2
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    data = tiny_hf[1]
    one = dpo(tmp_path / "ep1", driver, folder, data, 1)
    two = dpo(tmp_path / "ep2", driver, folder, data, 2, "--expert_model_parallel_size", "2")
    for rank in (*one, *two):
        assert rank["parameters"] > 0 and rank["experts"] > 0, rank
        assert rank["policy_optimized"] > 0
        assert rank["trainable"] == rank["with_grad"] == rank["optimized"] == [], rank
    # each EP rank's reference holds half the experts
    assert two[0]["experts"] == two[1]["experts"] < one[0]["experts"]
    ep1, ep2 = curve(tmp_path / "ep1"), curve(tmp_path / "ep2")
    assert sorted(ep1) == sorted(ep2) == [1, 2, 3]
    for it in ep1:
        for name in METRICS:
            assert name in ep1[it], (it, name)
            assert ep2[it][name] == pytest.approx(ep1[it][name], abs=1e-5), (it, name)
    assert ep1[3]["rewards/margins"] > 0  # it trained
