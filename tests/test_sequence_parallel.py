"""Sequence parallelism on CPU (gloo): TP=2 with --sequence_parallel computes what one rank
does (the norms' gradients summed over the TP ranks), and what CPU refuses with it."""

import pytest

from run_helpers import losses, run_pt, train_records
from swift_mcore.arguments import RunArguments, parse_args
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve

# LayerNorm (a weight and a bias) and the q/k norms: every norm slot of the local spec
# (sequence_parallel_norm.py); RMSNorm is the default.
# A high learning rate: Adam's step barely depends on a gradient's scale, so the partial
# (unreduced) norm gradients of a broken reduction show only where their sign differs.
SHAPE = ["--normalization", "LayerNorm", "--qk_layernorm", "--lr", "1e-2", "--min_lr", "1e-2"]


def test_tp2_sequence_parallel_gives_the_one_rank_losses(tmp_path, gloo_group):
    """TP=2 without SP gives the one-rank losses (test_training.py); with SP too. Without
    the norms' gradient reduction the losses differ from iteration 2 on. (The one rank
    trains in this process.)"""
    from in_process import train_in_process

    one, sp = tmp_path / "one", tmp_path / "sp"
    train_in_process(one, *SHAPE, "--train_iters", "3", "--no_save", command="pt")
    run_pt(sp, *SHAPE, "--train_iters", "3", "--no_save", "--tensor_model_parallel_size", "2",
           "--sequence_parallel", nproc=2, timeout=900)
    ref, got = losses(one), losses(sp)
    assert sorted(got) == [1, 2, 3]
    for it in ref:
        assert abs(got[it] - ref[it]) <= 1e-5, (it, got[it], ref[it])
    norms = zip(train_records(one), train_records(sp))
    assert all(abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 for a, b in norms)


def test_sequence_parallel_with_hidden_dropout_is_refused_on_cpu():
    args = parse_args(["--num_layers", "2", "--micro_batch_size", "1", "--global_batch_size",
                       "4", "--tensor_model_parallel_size", "2", "--sequence_parallel",
                       "--hidden_dropout", "0.1"])
    with pytest.raises(ArgumentError, match="--sequence_parallel with --hidden_dropout 0.1 "
                                            "on CPU.*set --hidden_dropout 0"):
        resolve(args, world_size=2, cuda=False)
    args.model.hidden_dropout = 0.0
    assert resolve(args, world_size=2, cuda=False).parallel.sequence_parallel


def test_a_seq_length_the_tensor_parallel_ranks_cannot_split_is_refused(tmp_path):
    """megatron scatters each row's positions over the TP ranks: pt's rows of --seq_length
    63 at TP=2 were an AssertionError in the first forward pass. sft pads its rows to a
    multiple of TP (except under pipeline parallelism, whose stages exchange rows of
    --seq_length positions)."""
    from swift_mcore.arguments.sft import SftArguments

    flags = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=63,
                 micro_batch_size=1, tensor_model_parallel_size=2, sequence_parallel=True,
                 hidden_dropout=0.0)
    message = (r"^--seq_length \(63\) must be a multiple of --tensor_model_parallel_size "
               r"\(2\) with --sequence_parallel: each tensor-parallel rank holds an equal "
               r"share of every row's --seq_length ")
    with pytest.raises(ArgumentError, match=message + "tokens$"):
        resolve(RunArguments.from_flags(**flags, global_batch_size=2), world_size=2,
                cuda=False)
    assert resolve(RunArguments.from_flags(**{**flags, "seq_length": 64},
                                           global_batch_size=2), world_size=2, cuda=False)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "a"}, '
                    '{"role": "assistant", "content": "b"}]}\n')
    sft = dict(flags, dataset=[str(data)])
    assert resolve(SftArguments.from_flags(**sft, global_batch_size=2), world_size=2,
                   cuda=False)
    with pytest.raises(ArgumentError, match=message + r"positions \(the pipeline stages"):
        resolve(SftArguments.from_flags(**sft, global_batch_size=4,
                                        pipeline_model_parallel_size=2),
                world_size=4, cuda=False)


def test_every_torch_norm_slot_of_the_local_spec_is_marked():
    from types import SimpleNamespace

    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from swift_mcore.models import sequence_parallel_norm as spn

    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    spn.use_in(spec)
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    slots = (layer.input_layernorm, layer.pre_mlp_layernorm, attention.q_layernorm,
             attention.k_layernorm)
    assert all(slot is spn.SequenceParallelNorm for slot in slots)
    # multi-latent attention: its latent norms work on the sequence shard too
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm",
                                    multi_latent_attention=True)
    spn.use_in(spec)
    attention = spec.submodules.self_attention.submodules
    assert attention.q_layernorm is attention.kv_layernorm is spn.SequenceParallelNorm
    norm = spn.SequenceParallelNorm(SimpleNamespace(normalization="LayerNorm",
                                                    sequence_parallel=True), 8, eps=1e-6)
    assert isinstance(norm, torch.nn.LayerNorm) and norm.eps == 1e-6
    assert [p.sequence_parallel for p in norm.parameters()] == [True, True]
