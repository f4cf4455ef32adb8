"""Tiny random Hugging Face models built from a config (nothing downloaded), and their logits."""

from __future__ import annotations

import json
import os
from typing import Dict

import torch

from run_helpers import free_port  # noqa: F401  (tests call H.free_port)

# One tiny config per family and trait: GQA everywhere, heads of 16 channels.
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=256,
            # A wide initialization makes attention peaked, so a wrong q/k/v layout or RoPE
            # shows in the logits (with 0.02 attention is nearly uniform).
            initializer_range=0.2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
               "rope_theta": 500000.0}
FAMILIES: Dict[str, tuple] = {
    "llama": ("llama", {}),
    "llama3": ("llama", {"rope_parameters": LLAMA3_ROPE, "max_position_embeddings": 16384}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mistral": ("mistral", {"sliding_window": None, "rms_norm_eps": 1e-5}),
}
EOD = "<|endoftext|>"


def write_tokenizer(path: str) -> None:
    """A byte-level BPE of under 300 tokens, trained in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOD).save_pretrained(path)


def make_model(path: str, model_type: str, seed: int = 0, tokenizer: bool = True, **overrides):
    """Save a random model of ``model_type`` (and a tokenizer) into ``path``; returns it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    model.save_pretrained(path)
    if tokenizer:
        write_tokenizer(path)
    return model.eval()


def make_family(path: str, family: str, **overrides):
    model_type, extra = FAMILIES[family]
    return make_model(path, model_type, **{**extra, **overrides})


def tokens(vocab: int = 300, batch: int = 2, length: int = 64, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator)


def hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


def safetensors_state(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of an HF folder's safetensors files, by name."""
    from safetensors.torch import load_file

    out: Dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def assert_same_weights(original, other) -> None:
    """The HF folder ``other`` holds every tensor of ``original``, bit for bit, and no other."""
    want, got = safetensors_state(str(original)), safetensors_state(str(other))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


def check_peft_loads_the_checkpoint(checkpoint, base, adapter, ids) -> None:
    """peft's PeftModel.from_pretrained(base, adapter) gives the checkpoint's logits within
    1e-4, and they are not the base model's (the adapters learned, and peft loaded them)."""
    from peft import PeftModel

    from swift_mcore.loaded_model import forward_logits, load_model

    ours = forward_logits(load_model(str(checkpoint), log=lambda line: None).model, ids)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    peft = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        theirs = peft(input_ids=ids).logits
    assert (ours[..., : theirs.shape[-1]] - theirs).abs().max() <= 1e-4
    assert (plain - theirs).abs().max() > 1e-3


def edit_config(path: str, **changes) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as fh:
        config = json.load(fh)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(config_path, "w") as fh:
        json.dump(config, fh)


def check_infer_is_greedy(folder, capsys, prompt: str = "def add(", new_tokens: int = 4):
    """`swift-mcore infer` on ``folder`` (its command in this process) prints the prompt and
    transformers' greedy continuation; returns the prompt's token count."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.infer import run

    capsys.readouterr()
    run(InferArguments(model=str(folder), prompt=prompt, max_new_tokens=new_tokens,
                       temperature=0.0).validate())
    out = capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = torch.tensor([tokenizer.encode(prompt)])
    hf = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
    new = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:]
    expected = prompt + tokenizer.decode([t for t in new.tolist() if t != tokenizer.eos_token_id])
    assert out.rstrip("\n") == expected, (out, expected)
    return ids.shape[1]


def convert(source, out, direction: str, **flags):
    """`swift-mcore export --to_mcore|--to_hf` in this process; returns its summary."""
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.export import run

    args = ExportArguments(model=str(source), output_dir=str(out), **{direction: True}, **flags)
    return run(args.validate(), log=lambda line: None)


def check_round_trip(source, tmp_path) -> Dict:
    """HF -> mcore (its --test_convert_precision within 1e-4) -> HF gives every tensor of
    ``source`` back bit for bit; returns the exported config.json."""
    checkpoint, back = tmp_path / "mcore", tmp_path / "back"
    assert convert(source, checkpoint, "to_mcore",
                   test_convert_precision=True)["max_logit_difference"] <= 1e-4
    convert(checkpoint, back, "to_hf")
    original, exported = safetensors_state(str(source)), safetensors_state(str(back))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    return json.loads((back / "config.json").read_text())
