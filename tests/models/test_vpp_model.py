"""The interleaved pipeline on what users run: a Hugging Face folder (--model) and LoRA.
In process: every pipeline rank's model chunks, built as megatron builds them (PP=2 x 2
virtual stages, the embedding and loss counted as layers), hold the HF weights of their own
layers and, with LoRA, the one-rank model's adapters, all of them. On 2 gloo ranks
(benchmark): sft --model, full and LoRA, gives the one-rank losses, resumes bit for bit, and
exports (--to_hf, --merge_lora, --to_peft) what the one-rank run exports."""

import contextlib
import json
import subprocess
import sys

import pytest
import torch

import hf_helpers as H
from run_helpers import ROOT, child_env, losses, short_conversations
from swift_mcore.arguments import RunArguments, SftArguments
from swift_mcore.run_config import resolve

VPP = ["--pipeline_model_parallel_size", "2", "--num_virtual_stages_per_pipeline_rank", "2"]
LORA = dict(tuner_type="lora", lora_rank=4, lora_alpha=16, lora_dropout=0.0)


@pytest.fixture(scope="module")
def deep_hf(tmp_path_factory):
    """(HF folder, conversations): a 4-layer tiny Llama, one layer per chunk at PP=2 x 2."""
    root = tmp_path_factory.mktemp("vpp_model")
    H.make_model(str(root / "hf"), "llama", initializer_range=0.02, num_hidden_layers=4)
    data = short_conversations(root / "chats.jsonl", WORDS, rows=48)
    return root / "hf", data


WORDS = ["add", "one", "two", "def", "return", "b"]


@pytest.fixture(scope="module")
def tied_hf(deep_hf):
    """A 4-layer tiny Qwen2 of tied embeddings: its output layer is the embedding, which at
    PP=2 x 2 lives on rank 0's first chunk and rank 1's last."""
    folder = deep_hf[0].parent / "tied"
    H.make_family(str(folder), "qwen2", initializer_range=0.02, num_hidden_layers=4)
    return folder


@pytest.fixture(scope="module")
def moe_hf(deep_hf):
    """A 4-layer tiny Qwen3-MoE (its norms and biases moved off their init values): LoRA on
    attention and on every expert, in every chunk."""
    from test_moe_families import make_moe

    folder = deep_hf[0].parent / "moe"
    make_moe(folder, "qwen3_moe", num_hidden_layers=4)
    return folder


@pytest.mark.parametrize("cls, extra", [(SftArguments, {}), (RunArguments, {}),
                                        (SftArguments, LORA), (RunArguments, LORA)],
                         ids=["sft", "pt", "sft_lora", "pt_lora"])
def test_the_interleaved_pipeline_takes_a_hf_folder_and_lora(deep_hf, cls, extra):
    folder, data = deep_hf
    config = resolve(cls.from_flags(model=str(folder), dataset=str(data), seq_length=32,
                                    micro_batch_size=1,
                                    global_batch_size=4, pipeline_model_parallel_size=2,
                                    num_virtual_stages_per_pipeline_rank=2, **extra),
                     world_size=2, cuda=False)
    assert config.args.virtual_stages() == 2
    assert config.args.pipeline_chunk_layers() == [[range(0, 1), range(2, 3)],
                                                   [range(1, 2), range(3, 4)]]


def test_a_lora_run_on_a_random_base_records_its_virtual_stages():
    """Without --model the frozen base is the seeded initialization, which each rank draws
    chunk by chunk: PP=2 x 2 virtual stages draws other weights than PP=2 (the first loss
    differs), so its checkpoints record another base and a resume across the two is
    refused (checkpointing/compat.py base_model_differences)."""
    def base(**flags):
        return resolve(RunArguments.from_flags(
            num_layers=4, hidden_size=64, num_attention_heads=4, micro_batch_size=1,
            global_batch_size=4, pipeline_model_parallel_size=2, **LORA, **flags),
            world_size=2, cuda=False).base_model

    assert base() == "random initialization (--seed 42, PP 2)"
    assert base(num_virtual_stages_per_pipeline_rank=2) == \
        "random initialization (--seed 42, PP 2 x 2 virtual stages)"


@contextlib.contextmanager
def pipeline_rank(monkeypatch, rank: int, size: int, virtual: int):
    """megatron's parallel state seen from pipeline rank ``rank`` of ``size`` (its own
    overrides, and the pipeline group's rank, from which its layers number themselves), on
    the one-rank group: what that rank builds and loads, in this process."""
    from megatron.core import parallel_state as ps

    from fake_group import GroupRank

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_group",
                        lambda *a, **kw: GroupRank(rank, size))
    ps.set_pipeline_model_parallel_world_size(size)
    ps.set_pipeline_model_parallel_rank(rank)
    ps.set_virtual_pipeline_model_parallel_world_size(virtual)
    try:
        yield
    finally:
        ps.set_pipeline_model_parallel_world_size(None)
        ps.set_pipeline_model_parallel_rank(None)
        ps.set_virtual_pipeline_model_parallel_world_size(None)
        monkeypatch.undo()


def test_hf_weights_and_adapters_land_in_every_chunk_as_megatron_numbers_its_layers(
        tmp_path, deep_hf, gloo_group, monkeypatch):
    """6 layers, PP=2 x 2 virtual stages, the embedding and the loss counted as layers
    (megatron's chunks: rank 0 holds the embedding + layer 0 and layers 3-4, rank 1 layers
    1-2 and layer 5 + the loss), tied embeddings (the last chunk's output layer is the
    embedding): every chunk's parameters are the one-rank model's of the same global name,
    every one-rank parameter is in exactly one chunk (the tied output layer aside), and
    LoRA puts the one-rank model's adapters, initial values included, into the chunks."""
    from swift_mcore.models import lora
    from swift_mcore.models.convert import global_name, layer_offset
    from swift_mcore.models.gpt import build_model
    from swift_mcore.models.hf_load import load_hf_weights
    from swift_mcore.runtime import seed

    folder = tmp_path / "hf"
    H.make_family(str(folder), "qwen2", num_hidden_layers=6)  # tied embeddings
    counted = dict(account_for_embedding_in_pipeline_split=True,
                   account_for_loss_in_pipeline_split=True)
    quiet = lambda line: None  # noqa: E731

    def built(world, **flags):
        config = resolve(SftArguments.from_flags(
            model=str(folder), dataset=str(deep_hf[1]), seq_length=32, micro_batch_size=1,
            global_batch_size=4, train_iters=1, **LORA, **flags), world_size=world, cuda=False).complete(320, None)
        seed.set_seed(1)
        chunks = build_model(config)
        load_hf_weights(config, chunks, log=quiet)
        plain = {global_name(n, layer_offset(c)): p.detach().clone()
                 for c in chunks for n, p in c.named_parameters()}
        lora.apply(config, chunks)
        adapted = {global_name(n, layer_offset(c)): p.detach().clone()
                   for c in chunks for n, p in c.named_parameters() if p.requires_grad}
        return config, chunks, plain, adapted

    _, one, whole, adapters = built(1)
    assert len(adapters) == 6 * 4 * 2  # A and B of qkv, proj, fc1, fc2 in each layer
    trainable_one = lora.parameter_counts(one)[0]
    seen, seen_adapters, trainable = {}, {}, 0
    for rank in (0, 1):
        with pipeline_rank(monkeypatch, rank, 2, 2):
            config, chunks, plain, adapted = built(
                2, pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2,
                **counted)
            assert [range(layer_offset(c), layer_offset(c) + len(c.decoder.layers))
                    for c in chunks] == config.args.pipeline_chunk_layers()[rank]
            trainable += lora.parameter_counts(chunks)[0]
        assert [hasattr(c, "embedding") for c in chunks] == [rank == 0, False]
        assert [hasattr(c, "output_layer") for c in chunks] == [False, rank == 1]
        for name, value in plain.items():
            assert name not in seen or name == "output_layer.weight", name
            assert torch.equal(value, whole.get(name, whole["embedding.word_embeddings.weight"]
                                           if name == "output_layer.weight" else None)), name
            seen[name] = rank
        for name, value in adapted.items():
            assert name not in seen_adapters and torch.equal(value, adapters[name]), name
            seen_adapters[name] = rank
    assert sorted(seen) == sorted([*whole, "output_layer.weight"])
    assert sorted(seen_adapters) == sorted(adapters)
    assert trainable == trainable_one
    # the layers are where megatron puts them (a name lands in the rank that holds it)
    assert [seen[f"decoder.layers.{i}.mlp.linear_fc2.weight"] for i in range(6)] == \
        [0, 1, 1, 0, 0, 1]


def sft_flags(folder, data, *extra):
    return ["--model", folder, "--dataset", data, "--template", "plain", "--seq_length", "32",
            "--micro_batch_size", "1", "--global_batch_size", "4", "--lr", "1e-3",
            "--min_lr", "1e-3", "--lr_warmup_iters", "0", "--lr_decay_style", "constant",
            "--log_interval", "1", "--eval_steps", "0", "--progress_bar", "false",
            "--tensorboard", "false", "--plot", "false", "--num_workers", "0",
            "--train_iters", "4", "--attention_backend", "sdpa", *extra]


def two_ranks(out, *flags):
    env = child_env(NPROC_PER_NODE="2", MASTER_PORT=str(H.free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "sft", *map(str, flags),
                           "--output_dir", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def lora_line(stdout):
    return next(line for line in stdout.splitlines() if line.startswith("--tuner_type lora:"))


TUNERS = {"full": [],  # on tied embeddings
          # the adapters start at zero: a larger step moves them
          "lora": ["--tuner_type", "lora", "--lora_rank", "4", "--lora_alpha", "16",
                   "--lora_dropout", "0", "--lr", "1e-2", "--min_lr", "1e-2"]}
TUNERS["lora_moe"] = TUNERS["lora"]  # on the Qwen3-MoE folder, experts adapted too


@pytest.mark.benchmark
@pytest.mark.parametrize("tuner", sorted(TUNERS))
def test_sft_from_a_hf_folder_gives_the_one_rank_run_resumes_and_exports(
        tuner, deep_hf, tied_hf, moe_hf, tmp_path, train_here):
    """sft --model at PP=2 x 2 virtual stages (full on tied embeddings, and LoRA with
    adapters in every chunk):
    the one-rank losses within 1e-5 (and, with LoRA, its trainable-parameter count); its
    iteration-2 checkpoint resumed in new processes gives its own losses bit for bit, the
    one-rank run's resumed there the one-rank losses within 1e-5; its
    final checkpoint exports (--to_hf, with LoRA --merge_lora and --to_peft) a folder whose
    transformers logits are the checkpoint's and the one-rank run's export's within 1e-4
    (peft loads the adapter onto the base folder)."""
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.export import run
    from swift_mcore.loaded_model import forward_logits, load_model

    folder = {"full": tied_hf, "lora": deep_hf[0], "lora_moe": moe_hf}[tuner]
    data = deep_hf[1]
    flags = sft_flags(folder, data, *TUNERS[tuner], "--save_steps", "2")
    one = train_here(tmp_path / "one", *flags, base=[]).stdout
    vpp = two_ranks(tmp_path / "vpp", *flags, *VPP)
    ref, got = losses(tmp_path / "one"), losses(tmp_path / "vpp")
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4] and ref[4] < ref[1]
    assert max(abs(got[i] - ref[i]) for i in ref) < 1e-5, (got, ref)
    if tuner != "full":
        assert lora_line(vpp) == lora_line(one)
    two_ranks(tmp_path / "resumed", *flags, *VPP, "--no_save",
              "--resume", tmp_path / "vpp" / "checkpoint" / "iter_0000002")
    again = losses(tmp_path / "resumed")
    assert again == {3: got[3], 4: got[4]}
    # the one-rank checkpoint (with LoRA its adapters and their Adam state) into the chunks
    two_ranks(tmp_path / "resharded", *flags, *VPP, "--no_save",
              "--resume", tmp_path / "one" / "checkpoint" / "iter_0000002")
    resharded = losses(tmp_path / "resharded")
    assert sorted(resharded) == [3, 4]
    assert max(abs(resharded[i] - ref[i]) for i in resharded) < 1e-5, (resharded, ref)

    quiet = lambda line: None  # noqa: E731
    ids = H.tokens(vocab=300, length=32)
    exported = {}
    for name in ("one", "vpp"):
        checkpoint = tmp_path / name / "checkpoint" / "iter_0000004"
        out = tmp_path / f"{name}_hf"
        run(ExportArguments(model=str(checkpoint), output_dir=str(out), to_hf=True,
                            merge_lora=tuner != "full").validate(), log=quiet)
        exported[name] = H.hf_logits(str(out), ids)
        ours = forward_logits(load_model(str(checkpoint), log=quiet).model, ids)
        assert (ours[..., :320] - exported[name]).abs().max() <= 1e-4, name
    assert (exported["vpp"] - exported["one"]).abs().max() <= 1e-4
    assert (exported["vpp"] - H.hf_logits(str(folder), ids)).abs().max() > 1e-3  # it trained
    if tuner != "full":
        from transformers import AutoModelForCausalLM

        adapters = {}
        for name in ("one", "vpp"):
            checkpoint = tmp_path / name / "checkpoint" / "iter_0000004"
            run(ExportArguments(model=str(checkpoint), output_dir=str(tmp_path / f"{name}_peft"),
                                to_peft=True).validate(), log=quiet)
            adapters[name] = H.safetensors_state(str(tmp_path / f"{name}_peft"))
        assert sorted(adapters["vpp"]) == sorted(adapters["one"])
        for key, value in adapters["one"].items():
            assert (adapters["vpp"][key] - value).abs().max() <= 1e-4, key
        assert json.loads((tmp_path / "vpp_peft" / "adapter_config.json").read_text()) == \
            json.loads((tmp_path / "one_peft" / "adapter_config.json").read_text())
        base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                    attn_implementation="eager")
        H.check_peft_loads_the_checkpoint(tmp_path / "vpp" / "checkpoint" / "iter_0000004",
                                          base, tmp_path / "vpp_peft", ids)
