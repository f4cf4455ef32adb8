"""Flags: parsing, YAML overrides, --help, and validation errors that name the flag."""

import dataclasses
import subprocess
import sys

import pytest

from swift_mcore.errors import ArgumentError
from swift_mcore.arguments import RunArguments, parse_args
from swift_mcore.arguments.parser import build_parser
from swift_mcore.arguments.run import flag_owners
from swift_mcore.run_config import resolve



def all_flags(cls=RunArguments):
    return [f for t in cls.GROUPS.values() for f in dataclasses.fields(t)]

def validated(*argv, world_size=1, cuda=False):
    return resolve(parse_args(list(argv)), world_size=world_size, cuda=cuda)


def test_defaults_validate_and_derive():
    args = parse_args([])
    config = resolve(args, world_size=1, cuda=False)
    assert config.world.data_parallel == 1
    assert config.world.num_microbatches == 16 // 4
    assert config.model.ffn_hidden_size == 704  # 8/3 * 256 rounded up to 64
    assert config.model.max_position_embeddings == config.model.seq_length
    # The arguments are left as given; the resolved flags are read-only.
    assert args.model.ffn_hidden_size is None
    assert args.model.max_position_embeddings is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.hidden_size = 8


def test_num_microbatches_uses_data_parallel_size():
    config = validated("--global_batch_size", "32", "--micro_batch_size", "2",
                       "--tensor_model_parallel_size", "2", world_size=8)
    assert config.world.data_parallel == 4
    assert config.world.num_microbatches == 4


def test_flags_are_typed_and_yaml_is_overridden(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lr: 3.0e-4\nnum_layers: 6\noverlap_grad_reduce: true\n")
    args = parse_args([str(config), "--num_layers", "8", "--seed", "7"])
    assert args.training.lr == pytest.approx(3e-4)
    assert args.model.num_layers == 8  # the flag wins over the YAML file
    assert args.training.seed == 7
    assert args.parallel.overlap_grad_reduce is True


def test_bool_flags_accept_bare_and_explicit_values():
    assert parse_args(["--swiglu", "false"]).model.swiglu is False
    assert parse_args(["--overlap_grad_reduce"]).parallel.overlap_grad_reduce is True
    assert parse_args(["--resume"]).checkpoint.resume == "auto"
    assert parse_args(["--resume", "/x/iter_0000010"]).checkpoint.resume == "/x/iter_0000010"


def test_every_flag_is_defined_once_and_listed_in_help():
    owners = flag_owners()  # raises if a name is defined in two groups
    help_text = build_parser().format_help()
    for f in all_flags():
        assert f"--{f.name}" in help_text
        assert f.metadata["help"], f.name
    assert len(owners) == len(all_flags())
    assert "(default: 1e-05)" in help_text or "(default: 1e-05" in help_text


def test_python_api_and_from_flags_agree():
    a = RunArguments.from_flags(lr=2e-4, num_layers=3)
    b = parse_args(["--lr", "2e-4", "--num_layers", "3"])
    assert a.to_dict() == b.to_dict()
    with pytest.raises(ArgumentError, match="unknown flag 'nope'"):
        RunArguments.from_flags(nope=1)


@pytest.mark.parametrize("argv, world_size, message", [
    (["--num_buckets", "0", "--overlap_grad_reduce"], 1, "--num_buckets must be a positive"),
    (["--num_buckets", "-3", "--overlap_grad_reduce"], 1, "--num_buckets must be a positive"),
    (["--bucket_size", "-1", "--overlap_grad_reduce"], 1, "--bucket_size must be a positive"),
    (["--num_buckets", "4"], 1, "need --overlap_grad_reduce"),
    (["--bf16"], 1, "--bf16 needs a CUDA GPU"),
    (["--fp16"], 1, "--fp16 needs a CUDA GPU"),
    (["--global_batch_size", "10", "--micro_batch_size", "4"], 1, "--global_batch_size (10)"),
    (["--global_batch_size", "12", "--micro_batch_size", "4"], 2, "data-parallel size (2)"),
    (["--tensor_model_parallel_size", "3"], 3, "must divide --num_attention_heads"),
    (["--tensor_model_parallel_size", "2"], 3, "world size (3 ranks)"),
    (["--pipeline_model_parallel_size", "3"], 3, "must divide --num_layers"),
    (["--hidden_size", "100"], 1, "divisible by --num_attention_heads"),
    (["--num_query_groups", "3"], 1, "divisible by --num_query_groups"),
    (["--lr_decay_style", "zigzag"], 1, "--lr_decay_style must be one of"),
    (["--min_lr", "1", "--lr", "0.1"], 1, "--min_lr"),
    (["--train_iters", "10"], 1, "--lr_warmup_iters (30)"),
    (["--seq_length", "512", "--max_position_embeddings", "256"], 1,
     "--max_position_embeddings"),
    (["--finetune"], 1, "--finetune needs --load"),
    (["--hidden_dropout", "1.5"], 1, "--hidden_dropout"),
])
def test_validation_errors_name_the_flag(argv, world_size, message):
    with pytest.raises(ArgumentError) as err:
        validated(*argv, world_size=world_size)
    assert message in str(err.value)


def test_type_errors_name_the_flag():
    with pytest.raises(ArgumentError, match="--lr takes a number"):
        parse_args(["--lr", "fast"])
    with pytest.raises(ArgumentError, match="--num_layers takes an integer"):
        parse_args(["--num_layers", "2.5"])


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: 1\n")
    with pytest.raises(ArgumentError, match="unknown key\\(s\\) learning_rate"):
        parse_args([str(bad)])
    with pytest.raises(ArgumentError, match="does not exist"):
        parse_args([str(tmp_path / "missing.yaml")])


def test_cli_reports_bad_flags_before_any_work(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "pt", "--num_buckets", "0",
         "--overlap_grad_reduce", "--output_dir", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--num_buckets must be a positive integer, got 0" in proc.stderr
    assert not out.exists()  # nothing was created


def test_cli_help_lists_flags_with_defaults():
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "pt", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "--global_batch_size INT" in proc.stdout
    assert "(default: 16)" in proc.stdout



def test_cli_reference_in_docs_is_current():
    from pathlib import Path

    from swift_mcore.arguments.reference import render

    docs = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
    assert docs.read_text() == render(), (
        "docs/cli.md is stale: python -m swift_mcore.arguments.reference > docs/cli.md")


def test_num_train_epochs_resolves_train_iters_once_the_data_size_is_known():
    args = RunArguments.from_flags(num_train_epochs=2.5, global_batch_size=16,
                                        lr_warmup_iters=5)
    config = resolve(args, world_size=1, cuda=False)  # the schedule check waits for the length
    done = config.complete(1000, 100)
    assert done.training.train_iters == 16  # ceil(2.5 * 100 / 16)
    assert config.training.train_iters != 16  # complete returns a new config
    short = RunArguments.from_flags(num_train_epochs=0.1, global_batch_size=16,
                                         lr_warmup_iters=5)
    short_config = resolve(short, world_size=1, cuda=False)
    with pytest.raises(ArgumentError, match=r"--lr_warmup_iters \(5\) must be smaller than "
                                            r"the decay length \(1,"):
        short_config.complete(1000, 100)
    with pytest.raises(ArgumentError, match=r"--num_train_epochs must be > 0 \(a positive "
                                            r"number\), got 0.0"):
        resolve(RunArguments.from_flags(num_train_epochs=0), world_size=1, cuda=False)
    # Without epochs, --train_iters stands.
    plain = RunArguments.from_flags(train_iters=7, lr_warmup_iters=1)
    assert resolve(plain, world_size=1, cuda=False).complete(1000, 100).training.train_iters == 7


def test_infer_and_export_check_their_choices():
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.arguments.infer import InferArguments

    with pytest.raises(ArgumentError, match="--template must be one of auto, tokenizer, "
                                            "chatml, plain; got 'nope'"):
        InferArguments(model="m", prompt="hi", template="nope").validate()
    with pytest.raises(ArgumentError, match="--dtype must be one of float32, bfloat16, "
                                            "float16; got 'int8'"):
        ExportArguments(model="m", to_hf=True, output_dir="o", dtype="int8").validate()
    with pytest.raises(ArgumentError, match="--system needs --template"):
        InferArguments(model=".", prompt="hi", system="be brief").validate()


# ---- float flags: finite and in range (fields.Range, checked by check_flags) -------------
def float_flags():
    """(command, argument class, field) of every float flag of every command."""
    from dataclasses import fields

    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.arguments.fields import base_type
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.arguments.sft import SftArguments
    from swift_mcore.preprocess import PreprocessArguments

    found = []
    for command, cls in (("pt", RunArguments), ("sft", SftArguments)):
        seen = {f.name for c, _, f in found if c == "pt"}
        found += [(command, cls, f) for f in all_flags(cls)
                  if base_type(f)[0] is float and f.name not in seen]
    for command, cls in (("export", ExportArguments), ("infer", InferArguments),
                         ("preprocess", PreprocessArguments)):
        found += [(command, cls, f) for f in fields(cls) if base_type(f)[0] is float]
    return found


def test_every_float_flag_declares_its_range():
    names = {f.name for _, _, f in float_flags()}
    assert {"lr", "adam_eps", "norm_epsilon", "clip_grad", "split_dataset_ratio",
            "temperature", "top_p", "exit_duration_in_mins"} <= names
    for _, _, f in float_flags():
        assert "range" in f.metadata, f"--{f.name}: declare flag(..., range=...)"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_flag_refuses_non_finite_values(value):
    for command, cls, f in float_flags():
        with pytest.raises(ArgumentError, match=rf"^--{f.name} must be a finite number"
                                                rf".*, got {value}$"):
            if command in ("pt", "sft"):
                resolve(cls.from_flags(**{f.name: value}), world_size=1, cuda=False)
            else:
                from swift_mcore.arguments.fields import check_flags

                check_flags(cls(**{f.name: value}))


@pytest.mark.parametrize("argv, message", [
    (["--adam_eps", "0"], "--adam_eps must be > 0 (a positive number), got 0.0"),
    (["--norm_epsilon", "0"], "--norm_epsilon must be > 0 (a positive number), got 0.0"),
    (["--init_method_std", "-0.02"], "--init_method_std must be > 0"),
    (["--lr", "-0.001"], "--lr must be >= 0 (zero or a positive number), got -0.001"),
    (["--clip_grad", "-1"], "--clip_grad must be >= 0"),
    (["--weight_decay", "-0.1"], "--weight_decay must be >= 0"),
    (["--adam_beta1", "1"], "--adam_beta1 must be in [0, 1), got 1.0"),
    (["--adam_beta2", "-0.5"], "--adam_beta2 must be in [0, 1), got -0.5"),
    (["--attention_dropout", "1"], "--attention_dropout must be in [0, 1), got 1.0"),
    (["--rotary_percent", "0"], "--rotary_percent must be in (0, 1], got 0.0"),
    (["--rotary_percent", "1.5"], "--rotary_percent must be in (0, 1], got 1.5"),
    (["--rope_scaling_factor", "0"], "--rope_scaling_factor must be > 0"),
    (["--num_train_epochs", "0"], "--num_train_epochs must be > 0 (a positive number)"),
    (["--exit_duration_in_mins", "0"], "--exit_duration_in_mins must be > 0"),
    (["--lr", "1e-3", "--min_lr", "-0.0001"], "--min_lr must be >= 0"),
    (["--nonfinite_policy", "ignore"], "--nonfinite_policy must be one of stop, skip"),
    (["--nonfinite_skip_limit", "0"], "--nonfinite_skip_limit must be a positive integer"),
])
def test_float_flags_out_of_range_name_the_flag_the_range_and_the_value(argv, message):
    with pytest.raises(ArgumentError) as err:
        validated(*argv)
    assert str(err.value) == message or str(err.value).startswith(message), str(err.value)


def test_float_ranges_accept_their_bounds():
    validated("--lr", "0", "--min_lr", "0", "--clip_grad", "0", "--weight_decay", "0",
              "--adam_beta1", "0", "--hidden_dropout", "0", "--rotary_percent", "1",
              "--lr", "1e30", "--min_lr", "0")
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.arguments.fields import check_flags

    check_flags(InferArguments(temperature=0.0, top_p=1.0))


def test_a_flag_may_opt_in_to_infinity():
    from dataclasses import dataclass

    from swift_mcore.arguments.fields import NON_NEGATIVE, check_flags, flag

    @dataclass
    class Group:
        budget: float = flag(1.0, "A limit; inf: none.", range=NON_NEGATIVE, allow_inf=True)

    check_flags(Group(budget="inf"))
    with pytest.raises(ArgumentError, match=r"--budget must be a finite number >= 0, got nan"):
        check_flags(Group(budget="nan"))
    with pytest.raises(ArgumentError, match=r"--budget must be >= 0 .*got -inf"):
        check_flags(Group(budget="-inf"))


@pytest.mark.parametrize("command, argv, message", [
    ("pt", ["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
    ("pt", ["--adam_eps", "0"], "--adam_eps must be > 0 (a positive number), got 0.0"),
    ("pt", ["--norm_epsilon", "nan"], "--norm_epsilon must be a finite number > 0, got nan"),
    ("pt", ["--clip_grad", "nan"], "--clip_grad must be a finite number >= 0, got nan"),
    ("pt", ["YAML"], "--hidden_dropout must be a finite number in [0, 1), got nan"),
    ("sft", ["--split_dataset_ratio", "nan", "--dataset", "none.jsonl"],
     "--split_dataset_ratio must be a finite number in [0, 1), got nan"),
    ("sft", ["YAML", "--dataset", "none.jsonl"],
     "--lr must be a finite number >= 0, got inf"),
    ("infer", ["--temperature", "nan", "--model", "nowhere", "--prompt", "hi"],
     "--temperature must be a finite number >= 0, got nan"),
    ("infer", ["--top_p", "inf", "--model", "nowhere", "--prompt", "hi"],
     "--top_p must be a finite number in (0, 1], got inf"),
])
def test_cli_refuses_non_finite_and_out_of_range_floats_before_any_work(
        tmp_path, command, argv, message):
    out = tmp_path / "out"
    if argv[0] == "YAML":  # YAML's own spellings of nan and inf
        config = tmp_path / "run.yaml"
        config.write_text("hidden_dropout: .nan\n" if command == "pt" else "lr: .inf\n")
        argv = [str(config), *argv[1:]]
    if command != "infer":
        argv = [*argv, "--output_dir", str(out)]
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", command, *argv],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"swift-mcore {command}: error: {message}"
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) in (
        [], ["run.yaml"])


@pytest.mark.parametrize("flags, message", [
    (dict(num_experts=4, moe_router_topk=1),
     r"^--moe_router_topk 1 needs --moe_router_pre_softmax: top-1 routing weights the chosen "
     r"expert by its softmax probability"),
    (dict(num_experts=4, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01),
     r"^--moe_router_load_balancing_type sinkhorn balances the experts without a loss; set "
     r"--moe_aux_loss_coeff 0"),
])
def test_moe_routing_megatron_refuses_is_refused_in_our_words(flags, message):
    from swift_mcore.run_config import resolve

    with pytest.raises(ArgumentError, match=message):
        resolve(RunArguments.from_flags(**flags), world_size=1, cuda=False)
    ok = resolve(RunArguments.from_flags(num_experts=4, moe_router_topk=1,
                                              moe_router_pre_softmax=True),
                 world_size=1, cuda=False)
    assert ok.model.moe_router_topk == 1


def test_num_layers_has_an_upper_bound():
    from swift_mcore.run_config import resolve

    with pytest.raises(ArgumentError, match=r"^--num_layers must be <= 1000000 \(at most a "
                                            r"million\), got 10000000$"):
        resolve(RunArguments.from_flags(num_layers=10**7), world_size=1, cuda=False)
