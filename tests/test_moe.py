"""Mixture of experts in process: the flags and their checks, the layer pattern, and the CPU
adaptations megatron's MoE layer needs (the runs are in test_moe_runs.py)."""

import numpy as np
import pytest
import torch

from swift_mcore.arguments import parse_args
from swift_mcore.arguments.model import ModelArguments, moe_layer_pattern
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve

def resolved(*argv, world_size=1, cuda=False):
    return resolve(parse_args(["--num_layers", "2", "--micro_batch_size", "1",
                              "--global_batch_size", "12", *argv]),
                   world_size=world_size, cuda=cuda)


@pytest.mark.parametrize("argv, world, message", [
    (["--num_experts", "4", "--expert_model_parallel_size", "3"], 3,
     "--expert_model_parallel_size (3) must divide --num_experts (4)"),
    (["--num_experts", "4", "--expert_model_parallel_size", "2"], 3,
     "must be divisible by --expert_model_parallel_size (2) x --tensor_model_parallel_size"),
    (["--num_experts", "4", "--moe_router_topk", "5"], 1,
     "--moe_router_topk (5) must not exceed --num_experts (4)"),
    (["--moe_router_topk", "3"], 1, "--moe_router_topk configures mixture-of-experts"),
    (["--expert_model_parallel_size", "2"], 2, "it needs --num_experts"),
    (["--num_experts", "4", "--moe_layer_freq", "[1,0,1]"], 1, "--moe_layer_freq takes"),
    (["--num_experts", "4", "--moe_layer_freq", "__import__('os')"], 1,
     "--moe_layer_freq takes"),
    (["--num_experts", "4", "--moe_grouped_gemm"], 1, "--moe_grouped_gemm needs CUDA"),
    (["--num_experts", "4", "--tensor_model_parallel_size", "2"], 2,
     "needs --sequence_parallel"),
    (["--num_experts", "4", "--moe_shared_expert_gate"], 1,
     "needs --moe_shared_expert_intermediate_size"),
    (["--num_experts", "0"], 1, "--num_experts must be a positive integer"),
])
def test_bad_moe_flags_name_the_flag(argv, world, message):
    with pytest.raises(ArgumentError) as err:
        resolved(*argv, world_size=world)
    assert message in str(err.value)


def test_layout_and_defaults():
    config = resolved("--num_experts", "4", "--expert_model_parallel_size", "2",
                      "--ffn_hidden_size", "96", world_size=4)
    assert config.world.expert_parallel == 2 and config.world.data_parallel == 4
    assert config.model.moe_ffn_hidden_size == 96  # default: --ffn_hidden_size


@pytest.mark.parametrize("freq, layers, pattern", [
    ("1", 4, [1, 1, 1, 1]), ("2", 4, [1, 0, 1, 0]), ("[0,1,1]", 3, [0, 1, 1]),
    ("([0]*1+[1]*3)", 4, [0, 1, 1, 1]),
])
def test_moe_layer_freq_as_megatron_spells_it(freq, layers, pattern):
    m = ModelArguments(num_layers=layers, moe_layer_freq=freq)
    assert moe_layer_pattern(m) == pattern


def test_layer_pattern_builds_dense_and_moe_layers(gloo_group):
    from swift_mcore.models.gpt import build_model
    from swift_mcore.runtime.seed import set_seed

    set_seed(1)
    config = resolved("--hidden_size", "32", "--num_attention_heads", "4", "--seq_length",
                      "16", "--num_experts", "4", "--moe_layer_freq", "[0,1]",
                      "--moe_shared_expert_intermediate_size", "16",
                      "--moe_shared_expert_gate").complete(256, None)
    model = build_model(config)[0]
    layers = model.decoder.layers
    assert type(layers[0].mlp).__name__ == "MLP" and type(layers[1].mlp).__name__ == "MoELayer"
    assert layers[1].mlp.shared_experts.use_shared_expert_gate
    ids = torch.randint(0, 256, (2, 16))
    out = model(ids, torch.arange(16).expand(2, 16),
                torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1))
    assert out.shape == (2, 16, 256) and torch.isfinite(out).all()


def test_experts_take_swiglu_with_megatrons_numbers(gloo_group, monkeypatch):
    """The routed and shared experts' MLPs use models/swiglu.py like the dense ones (less
    kept for the backward pass, fewer elementwise ops): outputs and gradients are
    bit-identical to megatron's own glu."""
    from swift_mcore.models import gpt
    from swift_mcore.runtime.seed import set_seed

    config = resolved("--hidden_size", "32", "--num_attention_heads", "4", "--seq_length",
                      "16", "--num_experts", "4", "--moe_layer_freq", "[0,1]",
                      "--moe_shared_expert_intermediate_size", "16",
                      "--moe_shared_expert_gate", "--moe_aux_loss_coeff", "0.01"
                      ).complete(256, None)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        set_seed(1)
        model = gpt.build_model(config)[0]
        loss = model(ids, torch.arange(16).expand(2, 16),
                     torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1), labels=ids)
        loss.float().sum().backward()
        return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    model, loss, grads = step()
    moe = model.decoder.layers[1].mlp
    assert {type(m.activation_func).__name__ for m in
            [*moe.experts.local_experts, moe.shared_experts]} == {"SwiGLU"}
    monkeypatch.setattr(gpt, "swiglu_module", lambda config: False)  # megatron's glu
    plain, loss_plain, grads_plain = step()
    assert type(plain.decoder.layers[1].mlp.experts.local_experts[0].activation_func) \
        .__name__ == "function"
    assert torch.equal(loss, loss_plain)
    assert all(torch.equal(grads[name], grads_plain[name]) for name in grads)


def test_router_loss_coefficients_are_scaled_by_tp():
    """megatron-core 0.16.1 weighs each TP rank's router losses by its 1/TP slice of the
    tokens: the coefficients it gets are the flags' times TP (models/gpt.py; the runs that
    show the effect are in test_moe_runs.py), and the flags themselves stay as given."""
    from swift_mcore.models.gpt import transformer_config

    flags = ["--num_experts", "4", "--moe_aux_loss_coeff", "0.01", "--moe_z_loss_coeff",
             "0.001"]
    one = transformer_config(resolved(*flags).complete(256, None), initialize=False)
    tp2 = resolved(*flags, "--tensor_model_parallel_size", "2", "--sequence_parallel",
                   world_size=2).complete(256, None)
    assert (one.moe_aux_loss_coeff, one.moe_z_loss_coeff) == (0.01, 0.001)
    assert tp2.model.moe_aux_loss_coeff == 0.01
    tc = transformer_config(tp2, initialize=False)
    assert (tc.moe_aux_loss_coeff, tc.moe_z_loss_coeff) == (0.02, 0.002)


def test_logged_z_loss_is_averaged_over_tp_and_dp(gloo_group):
    """megatron tracks the z-loss with no reduction group (each rank's own tokens); ours
    averages it over the TP x DP ranks, and a stage without MoE layers joins with zeros."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    from swift_mcore.training import moe_metrics

    config = resolved("--num_experts", "4", "--moe_aux_loss_coeff", "0.01",
                      "--moe_z_loss_coeff", "0.001", "--moe_layer_freq", "[0,1]")
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.clear()  # as on a stage whose layers are all dense
    assert moe_metrics.collect(config) == {"load_balancing_loss": 0.0, "z_loss": 0.0}
    assert tracker["z_loss"]["avg_group"] is \
        parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    moe_utils.save_to_aux_losses_tracker("z_loss", torch.tensor(3.0), 2, 2)
    # one MoE layer, 12 micro-batches (--global_batch_size 12 of 1 on one rank)
    assert moe_metrics.collect(config)["z_loss"] == pytest.approx(3.0 / 12)
    tracker.clear()


# ---- the CPU adaptations the MoE layer needs (runtime/cpu/cpu_compat.py) ------------------
def test_router_gating_without_transformer_engine(gloo_group):
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None  # megatron left the name undefined without TE
    x, w = torch.randn(5, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(out, x @ w.t())


def test_split_sizes_reach_all_to_all_as_numpy(gloo_group):
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    sizes = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 4]), as_numpy=True)
    assert isinstance(sizes, np.ndarray) and sizes.tolist() == [3, 4]
    kept = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1]))
    assert torch.is_tensor(kept)


def test_avg_all_reduce_and_stream_events_on_gloo(gloo_group):
    import torch.distributed as dist

    from swift_mcore.runtime.cpu import cpu_compat

    proxy = cpu_compat._CpuTorch()
    value = torch.tensor([4.0, 2.0])
    proxy.distributed.all_reduce(value, op=dist.ReduceOp.AVG)  # gloo itself refuses AVG
    assert value.tolist() == [4.0, 2.0]
    proxy.cuda.Stream().record_event().synchronize()


@pytest.mark.parametrize("argv, grouped", [
    ([], True),                                      # decided: TE's grouped GEMM
    (["--moe_grouped_gemm", "false"], False),        # the user's word stands
    (["--tuner_type", "lora"], False),               # grouped linears have no LoRA layer
    (["--add_bias_linear"], False),                  # expert biases (gpt-oss)
    (["--attention_backend", "sdpa"], False),        # the local spec: SequentialMLP
])
def test_gpu_moe_runs_choose_grouped_gemm_with_alltoall(argv, grouped):
    config = resolve(parse_args(["--num_layers", "2", "--micro_batch_size", "1",
                                 "--global_batch_size", "12", "--num_experts", "4", *argv]),
                     world_size=1, cuda=True, transformer_engine=True)
    assert config.model.moe_grouped_gemm is grouped
    assert config.model.moe_token_dispatcher_type == "alltoall"
    dense = resolve(parse_args(["--num_layers", "2", "--micro_batch_size", "1",
                                "--global_batch_size", "12"]), world_size=1, cuda=True,
                    transformer_engine=True)
    assert dense.model.moe_grouped_gemm is False
    assert resolved("--num_experts", "4").model.moe_grouped_gemm is False  # CPU
