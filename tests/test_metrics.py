"""Model FLOPs per token: 6 x the model's matmul weights + 12 x layers x seq x attention width."""

import pytest
import torch


@pytest.mark.parametrize("flags", [
    dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=32),
    dict(num_layers=3, hidden_size=96, num_attention_heads=6, num_query_groups=None,
         seq_length=128, swiglu=False, kv_channels=8),
])
def test_flops_per_token_counts_the_built_models_matmuls(gloo_group, flags):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import seed
    from swift_mcore.training.metrics import flops_per_token

    args = resolve(RunArguments.from_flags(**flags), world_size=1, cuda=False).complete(
        256, None, padded_vocab_size=256)
    seed.set_seed(0)
    model = build_model(args)[0]
    # Every 2-D weight but the input embedding (a lookup, not a matmul) is one multiply-add
    # per token and entry.
    matmul = sum(p.numel() for name, p in model.named_parameters()
                 if p.dim() == 2 and "word_embeddings" not in name)
    m = args.model
    width = m.num_attention_heads * (m.kv_channels or m.hidden_size // m.num_attention_heads)
    expected = 6 * matmul + 12 * m.num_layers * m.seq_length * width
    assert flops_per_token(args) == pytest.approx(expected, rel=1e-12)


def tiny(**flags):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                seq_length=32)
    return resolve(RunArguments.from_flags(**base, **flags), world_size=1,
                   cuda=False).complete(256, None, padded_vocab_size=256)


def test_flops_by_hand_with_and_without_recompute():
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve
    from swift_mcore.training.metrics import (
        executed_flops_per_token,
        flops_per_token,
        recompute_flops_per_token,
    )

    # hidden 64, 4 heads of 16, 2 KV groups, SwiGLU ffn 192 (8/3 x 64 rounded up to 64),
    # seq 32, padded vocab 256. Per layer and token (multiply-adds):
    #   q,k,v,o projections 64*16*(4+2*2) + 4*16*64 = 12288; MLP 3*64*192 = 36864;
    #   scores and values 2*32*4*16 = 4096  -> 53248. Output layer 64*256 = 16384.
    # Training: 6 x (2*53248 + 16384) = 737280 FLOPs per token.
    assert flops_per_token(tiny()) == 737280
    assert recompute_flops_per_token(tiny()) == 0
    # full recompute runs each recomputed layer's forward again: 2 x multiply-adds
    full = tiny(recompute_granularity="full")
    assert recompute_flops_per_token(full) == 2 * 2 * 53248
    assert executed_flops_per_token(full) == 737280 + 212992
    block = tiny(recompute_granularity="full", recompute_method="block",
                 recompute_num_layers=1)
    assert recompute_flops_per_token(block) == 2 * 1 * 53248
    # block recomputes in each model chunk: PP=2 x 2 virtual stages of one layer each
    # recompute all four layers, an uneven split 1 of its first stage's and 1 of the other's
    chunked = [resolve(RunArguments.from_flags(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        seq_length=32, pipeline_model_parallel_size=2, recompute_granularity="full",
        recompute_method="block", recompute_num_layers=1, **flags), world_size=2,
        cuda=False).complete(256, None, padded_vocab_size=256) for flags in (
            dict(num_virtual_stages_per_pipeline_rank=2),
            dict(decoder_first_pipeline_num_layers=1))]
    assert [recompute_flops_per_token(c) for c in chunked] == [2 * 4 * 53248, 2 * 2 * 53248]
    assert recompute_flops_per_token(tiny(recompute_granularity="selective")) == 2 * 2 * 4096
    assert recompute_flops_per_token(tiny(recompute_granularity="selective",
                                          recompute_modules="mlp,layernorm")) == 2 * 2 * 36864


def test_log_window_mfu_and_memory():
    from swift_mcore.training.metrics import LogWindow

    window = LogWindow(1e9, world_size=2, peak_tflops=0.5, memory_gb=lambda: 1.25)
    window.add({"lr": 1e-3, "skipped": 0.0, "loss": 2.0, "grad_norm": 1.0, "tokens": 4096.0})
    m = window.flush()
    assert m["tflops"] == pytest.approx(m["tokens_per_s"] * 1e9 / 2 / 1e12)
    assert m["mfu_percent"] == pytest.approx(100 * m["tflops"] / 0.5)
    assert m["peak_memory_gb"] == 1.25
    bare = LogWindow(1e9, 1)
    bare.add({"lr": 1e-3, "skipped": 0.0, "tokens": 1.0})
    assert "mfu_percent" not in bare.flush()  # no peak known: no MFU


@pytest.mark.parametrize("name, model, tflops", [
    ("NVIDIA H200", "H200", 989.4), ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0), ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
    ("NVIDIA L40S", "L40S", 362.1), ("NVIDIA L4", "L4", 121.0), ("NVIDIA A10", "A10", 125.0),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2), ("Tesla T4", None, None),
])
def test_data_sheet_peaks(name, model, tflops):
    from swift_mcore.training.peak import data_sheet_peak

    assert data_sheet_peak(name) == ((model, tflops) if model else None)


def test_peak_override_cpu_measurement_and_its_cache(monkeypatch, tmp_path):
    from swift_mcore.training import peak

    assert peak.device_peak(7.5, cuda=False).describe() == "7.5 TFLOP/s (--peak_tflops)"
    monkeypatch.setenv("SWIFT_MCORE_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(peak, "measure_matmul_tflops", lambda device: calls.append(device) or 0.04)
    first = peak.device_peak(None, cuda=False)
    assert first.tflops == 0.04 and "float32 matmul measured on this CPU" in first.source
    assert peak.device_peak(None, cuda=False).tflops == 0.04 and calls == ["cpu"]  # cached
    assert peak.device_peak(None, cuda=False, measure=lambda d: 2.0).tflops == 2.0


def test_measured_cpu_peak_is_plausible():
    from swift_mcore.training.peak import measure_matmul_tflops

    assert 1e-4 < measure_matmul_tflops("cpu", sizes=(256,), repeats=2) < 100


def test_measuring_the_peak_leaves_the_run_s_random_numbers_alone():
    # The peak is measured after seeding on a cold cache only: drawing from torch's global
    # generator there made a run's dropout masks depend on whether the cache was warm.
    from swift_mcore.training.peak import measure_matmul_tflops

    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    measure_matmul_tflops("cpu", sizes=(64,), repeats=1)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.slow
def test_metrics_jsonl_has_mfu_and_memory(tmp_path, monkeypatch):
    from run_helpers import run_pt, train_records

    for name in ("MASTER_ADDR", "MASTER_PORT"):  # this module's gloo group holds its port
        monkeypatch.delenv(name, raising=False)

    proc = run_pt(tmp_path, "--train_iters", "2", "--no_save", "--peak_tflops", "0.5")
    assert "MFU against 0.5 TFLOP/s (--peak_tflops)" in proc.stdout
    assert "MFU " in proc.stdout and " GB" in proc.stdout
    for record in train_records(tmp_path):
        assert record["tflops"] > 0
        assert record["mfu_percent"] == pytest.approx(100 * record["tflops"] / 0.5)
        assert 0.05 < record["peak_memory_gb"] < 64  # the process's RSS peak, in GB


def test_the_lr_logged_at_an_iteration_is_the_rate_it_trained_with(gloo_group, tmp_path):
    """The optimizer step of iteration k uses the scheduler's rate of step k-1; the record
    of iteration k says that rate (not the next iteration's, set by the scheduler's step
    after the update). Warmup and cosine decay make every iteration's rate differ."""
    from in_process import train_in_process
    from run_helpers import train_records
    from swift_mcore.training.trainer import Trainer

    used = {}

    class Watching(Trainer):
        def optimizer_step(self, loss):
            used[self.state.iteration + 1] = self.optimizer.param_groups[0]["lr"]
            return super().optimizer_step(loss)

    train_in_process(tmp_path, "--train_iters", "4", "--lr_warmup_iters", "2",
                     "--lr_decay_style", "cosine", "--min_lr", "1e-4", "--no_save",
                     command="pt", trainer=Watching)
    logged = {r["iteration"]: r["lr"] for r in train_records(tmp_path)}
    assert len(set(used.values())) == 4  # the rate changes every iteration
    assert logged == used
