"""A vision-language model's parts trained apart: --vit_lr and --aligner_lr give the tower
and the merger(s) their own learning rate in megatron's param groups (training/optimizer.py);
with --tuner_type lora, --freeze_vit false puts adapters on the tower's linear layers."""

import pytest
import torch

import hf_helpers as H
from test_qwen2_5_vl import image_dataset, vl_folder  # noqa: F401  (the module's fixture)


def test_part_lrs_are_param_groups_of_their_parts(vl_folder):  # noqa: F811
    """The overrides match the tower's and the merger's parameters (through DDP's module.
    prefix), with the peak lr asked and --min_lr's ratio to --lr."""
    from megatron.core.optimizer import OptimizerConfig

    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve
    from swift_mcore.training.optimizer import part_overrides

    flags = dict(model=str(vl_folder), lr=1e-2, min_lr=1e-3, freeze_vit=False,
                 freeze_aligner=False)
    config = resolve(RunArguments.from_flags(**flags, vit_lr=2e-3, aligner_lr=4e-2),
                     world_size=1)
    overrides = part_overrides(config, OptimizerConfig(lr=1e-2, min_lr=1e-3))
    param = torch.nn.Parameter(torch.zeros(2, 2))

    def lr_of(name):
        found = [o for k, o in overrides.items() if k.matches(param, name) and "max_lr" in o]
        assert len(found) <= 1, name
        return (found[0]["max_lr"], found[0]["min_lr"]) if found else None

    assert lr_of("module.module.visual.blocks.0.attn.qkv.weight") == (2e-3, pytest.approx(2e-4))
    assert lr_of("module.visual.patch_embed.proj.weight") == (2e-3, pytest.approx(2e-4))
    assert lr_of("module.visual.merger.mlp.0.weight") == (4e-2, pytest.approx(4e-3))
    assert lr_of("module.visual.deepstack_merger_list.0.linear_fc1.weight") == (
        4e-2, pytest.approx(4e-3))
    assert lr_of("module.decoder.layers.0.mlp.linear_fc1.weight") is None
    # without the flags: megatron's own default groups
    plain = resolve(RunArguments.from_flags(**flags), world_size=1)
    assert part_overrides(plain, OptimizerConfig(lr=1e-2)) is None


def test_a_step_moves_each_part_by_its_lr(tmp_path, train_here, vl_folder):  # noqa: F811
    """One Adam step (no warmup, no decay, no weight decay) moves a weight by at most its
    lr and the largest move is near it: the language model by --lr, the merger by
    --aligner_lr; --vit_lr 0 keeps the tower bit for bit though it trains."""
    from test_hf_training import run_flags

    data = image_dataset(tmp_path, rows=8)
    out = tmp_path / "run"
    train_here(out, "--model", vl_folder, "--dataset", data, "--seq_length", "64",
               "--lr", "1e-3", "--min_lr", "1e-3", "--lr_warmup_iters", "0",
               "--weight_decay", "0", "--train_iters", "1", "--template", "tokenizer",
               "--save_steps", "1", "--freeze_vit", "false", "--freeze_aligner", "false",
               "--vit_lr", "0", "--aligner_lr", "2e-2", base=run_flags())
    H.convert(out / "checkpoint", tmp_path / "hf", "to_hf")
    source, exported = H.safetensors_state(str(vl_folder)), H.safetensors_state(
        str(tmp_path / "hf"))
    from swift_mcore.models.vision import part_of

    moved = {"vit": 0.0, "aligner": 0.0, "llm": 0.0}
    for name, tensor in source.items():
        part = part_of(name[len("model."):] if name.startswith("model.") else name)
        moved[part] = max(moved[part], float((exported[name] - tensor).abs().max()))
    assert moved["vit"] == 0.0
    assert 0.5e-3 < moved["llm"] <= 1e-3 * 1.001
    assert 1e-2 < moved["aligner"] <= 2e-2 * 1.001


def test_part_lrs_are_checked(vl_folder):  # noqa: F811
    from swift_mcore.arguments import RunArguments
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    with pytest.raises(ArgumentError, match="--vit_lr 0.001 is a flag of vision-language "
                                            "models; this is a text model"):
        resolve(RunArguments.from_flags(vit_lr=1e-3), world_size=1)
    with pytest.raises(ArgumentError, match=r"--vit_lr 0.001: that part does not train here "
                                            r"\(it needs --tuner_type full and --freeze_vit"):
        resolve(RunArguments.from_flags(model=str(vl_folder), vit_lr=1e-3), world_size=1)
    with pytest.raises(ArgumentError, match="--aligner_lr 0.001: that part does not train"):
        resolve(RunArguments.from_flags(model=str(vl_folder), aligner_lr=1e-3,
                                        freeze_aligner=False, tuner_type="lora"), world_size=1)


def test_lora_on_the_tower_resumes_and_merges_into_transformers_logits(
        tmp_path, train_here, vl_folder):  # noqa: F811
    """--tuner_type lora --freeze_vit false: adapters on the tower's linear layers (and the
    language model's); a resume continues them exactly; the merged export changes the
    tower's linear weights and the language model's and nothing else, and transformers on
    it gives the LoRA model's logits on an image prompt."""
    from run_helpers import losses
    from test_hf_training import run_flags
    from test_qwen2_5_vl import IMAGE, image_prompt, transformers_model

    from swift_mcore.loaded_model import load_model
    from swift_mcore.models.vision import part_of

    data = image_dataset(tmp_path, rows=8)
    flags = ["--model", vl_folder, "--dataset", data, "--seq_length", "64", "--lr", "5e-2",
             "--min_lr", "5e-2", "--train_iters", "2", "--template", "tokenizer",
             "--tuner_type", "lora", "--freeze_vit", "false"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_here(straight, *flags, "--save_steps", "1", base=run_flags())
    train_here(resumed, *flags, "--no_save", "--resume",
               straight / "checkpoint" / "iter_0000001", base=run_flags())
    assert losses(resumed) == {2: losses(straight)[2]}

    checkpoint = straight / "checkpoint"
    loaded = load_model(str(checkpoint), log=lambda line: None)
    adapted = {n for n, p in loaded.model.named_parameters() if "lora_A" in n}
    assert any(n.startswith("visual.blocks.") for n in adapted)
    assert not any(n.startswith("visual.merger.") for n in adapted)
    H.convert(checkpoint, tmp_path / "hf", "to_hf", merge_lora=True)
    from swift_mcore.errors import ArgumentError

    with pytest.raises(ArgumentError, match=r"--to_peft: visual\.blocks\.0\.attn\.qkv "
                                            r"\(the vision tower's\) has an adapter"):
        H.convert(checkpoint, tmp_path / "peft", "to_peft")
    assert not (tmp_path / "peft" / "adapter_model.safetensors").exists()
    source, exported = H.safetensors_state(str(vl_folder)), H.safetensors_state(
        str(tmp_path / "hf"))
    changed = {n for n, t in source.items() if not torch.equal(exported[n], t)}
    tower = {n for n in changed if n.startswith("visual.")}
    assert tower and all(part_of(n) == "vit" and n.endswith(".weight")
                         and ("attn." in n or "mlp." in n) for n in tower)
    assert any(n.startswith("model.layers.") for n in changed)
    ids, pixels, grids = image_prompt([(1, 4, 8)])
    with torch.no_grad():
        ours = loaded.model.eval()(input_ids=ids, position_ids=None, attention_mask=None,
                                   pixel_values=pixels, image_grid_thw=grids)[..., :320]
        theirs = transformers_model(tmp_path / "hf")(
            input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
            mm_token_type_ids=(ids == IMAGE).int()).logits
        before = transformers_model(vl_folder)(
            input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
            mm_token_type_ids=(ids == IMAGE).int()).logits
    assert (ours - theirs).abs().max() <= 1e-4
    assert (theirs - before).abs().max() > 1e-3
    # a resume with another part lr is refused (the optimizer's saved groups would win)
    from swift_mcore.checkpointing import compat

    assert compat.field_differences({"training": {"vit_lr": 1e-3}},
                                    {"training": {"vit_lr": 2e-3}}, compat.OPTIMIZER_FIELDS) \
        == ["--vit_lr: checkpoint 0.001, now 0.002"]
