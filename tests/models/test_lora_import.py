"""--adapters: a peft LoRA adapter made on a Hugging Face model, imported into megatron's
fused layers: the same logits as peft's own model, training continues from it (at TP=2
too), export --to_peft gives it back to peft, and bad adapters are refused naming the file
and field."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import hf_helpers as H
from test_hf_training import continue_pretraining, run_flags
from run_helpers import ROOT, child_env, losses, run_or_kill

from swift_mcore.arguments import RunArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Per-part ranks and alphas (peft's patterns) with rslora; and peft's default q/v targets on
# one layer only (k's block of the fused layer starts at zero).
ADAPTERS = {
    "patterns_rslora": dict(r=2, lora_alpha=8, target_modules=ALL, use_rslora=True,
                            rank_pattern={"q_proj": 3, "down_proj": 1},
                            alpha_pattern={"v_proj": 5, "up_proj": 2}),
    "qv_one_layer": dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                         layers_to_transform=[1]),
}


def quiet(_line):
    pass


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_import")
    H.make_family(str(root / "hf"), "llama", initializer_range=0.05)
    return root


def make_adapter(hf, out, seed=0, **lora):
    """A peft adapter on the HF model with every factor random (B nonzero), saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(lora_dropout=0.0, **lora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(str(out))
    return out


def peft_logits(hf, adapter, tokens):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                 attn_implementation="eager")
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(tokens).logits


def lora_config(hf, adapter, **flags):
    args = RunArguments.from_flags(model=str(hf), tuner_type="lora", adapters=str(adapter),
                                        attention_backend="sdpa", **flags)
    return resolve(args, world_size=1).complete(320, None)


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_an_imported_adapter_gives_peft_logits(base, kind, gloo_group):
    from swift_mcore.loaded_model import forward_logits
    from swift_mcore.models import lora
    from swift_mcore.models.gpt import build_model
    from swift_mcore.models.hf_load import load_hf_weights

    adapter = make_adapter(base / "hf", base / kind, **ADAPTERS[kind])
    config = lora_config(base / "hf", adapter)
    model = build_model(config)[0]
    load_hf_weights(config, [model], log=quiet)
    tokens = H.tokens(vocab=300, length=32)
    plain = forward_logits(model, tokens)[..., :320]
    lora.apply(config, [model])
    ours = forward_logits(model, tokens)[..., :320]
    theirs = peft_logits(base / "hf", adapter, tokens)
    # rslora's scale (alpha / sqrt(r): 8 on the rank-1 down_proj) multiplies the fp32
    # rounding in which our fused q/k/v and gate/up GEMMs differ from peft's separate ones
    assert (ours - theirs).abs().max() < 5e-5
    assert (ours - plain).abs().max() > 1e-2  # the adapter does something
    t = config.tuner
    spec = ADAPTERS[kind]
    assert (t.lora_rank, t.lora_alpha, t.use_rslora) == (spec["r"], spec["lora_alpha"],
                                                         spec.get("use_rslora", False))


@pytest.fixture(scope="module")
def continued(base, train_here):
    """The patterned adapter (without rslora) trained on for 2 iterations at TP=1 (in this
    process) and TP=2 (each run is mostly its start-up: 2 iterations show what 4 did, in
    less time)."""
    adapter = make_adapter(base / "hf", base / "train_adapter", seed=1,
                           **{**ADAPTERS["patterns_rslora"], "use_rslora": False})
    data = base / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    flags = ["--tuner_type", "lora", "--adapters", str(adapter), "--lora_dropout", "0",
             "--attention_backend", "sdpa", "--train_iters", "2"]
    train_here(base / "tp1", "--model", base / "hf", "--dataset", data, *flags, command="pt",
               base=run_flags())
    continue_pretraining(base / "hf", data, base / "tp2", *flags,
                         "--tensor_model_parallel_size", "2", nproc=2)
    return adapter


@pytest.mark.slow
def test_training_continues_from_the_adapter_and_exports_back_to_peft(base, continued,
                                                                     gloo_group, tmp_path):
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.export import run
    from swift_mcore.loaded_model import forward_logits, load_model

    tp1, tp2 = losses(base / "tp1"), losses(base / "tp2")
    assert sorted(tp1) == sorted(tp2) == [1, 2] and tp1[2] < tp1[1]
    # TP=2 shards the fused factors as it shards the base weights: the same losses.
    assert max(abs(tp2[i] - tp1[i]) for i in tp1) < 1e-5
    # The first loss is the imported adapter's: not the base model's.
    tokens = H.tokens(vocab=300, length=32)
    checkpoint = base / "tp1" / "checkpoint" / "iter_0000002"
    out = tmp_path / "adapter"
    run(ExportArguments(model=str(checkpoint), output_dir=str(out), to_peft=True).validate(),
        log=quiet)
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["r"] == 2 and saved["rank_pattern"]["model.layers.0.self_attn.q_proj"] == 7
    ours = forward_logits(load_model(str(checkpoint), log=quiet).model, tokens)[..., :320]
    theirs = peft_logits(base / "hf", out, tokens)
    assert (ours - theirs).abs().max() < 1e-5
    assert (theirs - peft_logits(base / "hf", continued, tokens)).abs().max() > 1e-4


def fake_adapter(folder, tensors, **config):
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("tensors, config, flags, message", [
    ({}, dict(use_dora=True), {}, "adapter_config.json: use_dora is True: DoRA"),
    ({}, dict(peft_type="IA3"), {}, "peft_type is 'IA3'; swift-mcore imports LoRA adapters"),
    ({"base_model.model.lm_head.lora_A.weight": (2, 64)}, {}, {},
     "tensor base_model.model.lm_head.lora_A.weight is not a LoRA factor of a projection"),
    ({Q + ".lora_A.weight": (2, 32), Q + ".lora_B.weight": (64, 2)}, {}, {},
     "model.layers.0.self_attn.q_proj: lora_A [2, 32], lora_B [64, 2]; --model"),
    ({Q.replace("layers.0", "layers.5") + ".lora_A.weight": (2, 64)}, {}, {},
     "has no module model.layers.5.self_attn.q_proj (2 layers"),
    ({Q + ".lora_A.weight": (2, 64), Q + ".lora_B.weight": (64, 2)}, {}, dict(lora_rank=8),
     "sets the LoRA shape, and these flags disagree with it: --lora_rank 8 (the adapter's 2)"),
    ({Q + ".lora_A.weight": (3, 64), Q + ".lora_B.weight": (64, 3)}, {}, {},
     "q_proj has rank 3, adapter_config.json's r/rank_pattern say 2"),
])
def test_bad_adapters_are_refused_naming_the_file(base, tmp_path, tensors, config, flags,
                                                  message):
    folder = fake_adapter(tmp_path / "adapter", {k: torch.zeros(s) for k, s in tensors.items()}
                          or {Q + ".lora_A.weight": torch.zeros(2, 64)}, **config)
    with pytest.raises(ArgumentError) as err:
        lora_config(base / "hf", folder, **flags)
    assert message in str(err.value)


def test_adapters_needs_lora_and_the_base_model(base, tmp_path):
    with pytest.raises(ArgumentError, match="--adapters configures LoRA adapters: add "
                                            "--tuner_type lora"):
        resolve(RunArguments.from_flags(model=str(base / "hf"), adapters=str(tmp_path)),
                world_size=1)
    with pytest.raises(ArgumentError, match="give that folder as --model"):
        resolve(RunArguments.from_flags(tuner_type="lora", adapters=str(tmp_path),
                                             attention_backend="sdpa"), world_size=1)
    with pytest.raises(ArgumentError, match="no adapter_config.json in"):
        lora_config(base / "hf", tmp_path)


def test_an_integer_adapter_is_refused_naming_the_tensor_and_dtype(base, tmp_path):
    # int8 factors (a quantized adapter) used to be read as floats of their integer values
    folder = fake_adapter(tmp_path / "adapter", {
        Q + ".lora_A.weight": torch.ones(2, 64, dtype=torch.int8),
        Q + ".lora_B.weight": torch.zeros(64, 2)})
    message = (f"adapter_model.safetensors: tensor {Q}.lora_A.weight has dtype I8; LoRA "
               f"factors are floating point (F64, F32, F16, BF16)")
    with pytest.raises(ArgumentError, match=re.escape(message)):
        lora_config(base / "hf", folder)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "pt", "--model",
                           str(base / "hf"), "--tuner_type", "lora", "--adapters", str(folder),
                           "--attention_backend", "sdpa", "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].endswith(message)
    assert not out.exists()


# ---- hostile adapter folders (issue 35): the CLI in a subprocess in its own process group,
# killed on timeout, so a regression that blocks on a FIFO fails instead of hanging.

def refused_pt(base, folder, out, timeout=180):
    proc = run_or_kill([sys.executable, "-m", "swift_mcore", "pt", "--model", str(base / "hf"),
                        "--tuner_type", "lora", "--adapters", str(folder), "--attention_backend",
                        "sdpa", "--output_dir", str(out)], timeout, cwd=ROOT, env=child_env())
    if proc is None:
        pytest.fail(f"pt --adapters {folder} still ran after {timeout} s (blocked?)")
    err = proc.stderr
    assert proc.returncode == 2 and "Traceback" not in err, err[-2000:]
    assert not out.exists()
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_fifo_in_the_adapter_folder_is_refused_naming_it(base, tmp_path, name):
    import os

    folder = fake_adapter(tmp_path / "adapter", {Q + ".lora_A.weight": torch.zeros(2, 64)})
    os.remove(folder / name)
    os.mkfifo(folder / name)
    line = refused_pt(base, folder, tmp_path / "out")
    assert line.endswith(f"error: {folder / name}: is a FIFO (named pipe), not a regular "
                         f"file; swift-mcore reads input only from regular files"), line


@pytest.mark.parametrize("content, message", [
    (b"", "is not a readable safetensors file (SafetensorError: Error while deserializing "
          "header: "),
    (None, "is not a readable safetensors file (SafetensorError: Error while deserializing "
           "header: "),
])
def test_a_truncated_adapter_is_one_line_naming_it(base, tmp_path, content, message):
    folder = fake_adapter(tmp_path / "adapter", {Q + ".lora_A.weight": torch.zeros(2, 64)})
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) - 16] if content is None else content)
    with pytest.raises(ArgumentError) as err:
        lora_config(base / "hf", folder)
    assert str(err.value).startswith(f"{weights} {message}"), str(err.value)
    assert "\n" not in str(err.value)


def test_adapter_config_nested_100000_deep_is_one_line(base, tmp_path):
    folder = fake_adapter(tmp_path / "adapter", {Q + ".lora_A.weight": torch.zeros(2, 64)})
    config = folder / "adapter_config.json"
    config.write_text('{"peft_type": "LORA", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ArgumentError, match=re.escape(
            f"{config}: JSON nested 100001 levels deep; at most 512 are read")):
        lora_config(base / "hf", folder)


def test_the_base_fingerprint_never_blocks_on_a_fifo_named_like_a_shard(tmp_path):
    """LoRA checkpoints record their base folder's fingerprint, read from every *.safetensors
    there (also one the index does not list): a FIFO among them is refused, never waited on."""
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    os.mkfifo(tmp_path / "stray.safetensors")
    code = ("from swift_mcore.models import lora\n"
            "from swift_mcore.errors import ArgumentError\n"
            f"try:\n    lora.folder_fingerprint({str(tmp_path)!r})\n"
            "except ArgumentError as err:\n    print('refused:', err)\n")
    proc = run_or_kill([sys.executable, "-c", code], 60, cwd=ROOT, env=child_env())
    assert proc is not None, "folder_fingerprint blocked on the FIFO"
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused:" in proc.stdout and "stray.safetensors" in proc.stdout, proc.stdout
