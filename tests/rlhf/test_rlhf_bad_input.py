"""Bad preference input: one line naming the flag, file and row, exit 2, before any work."""

import json
import subprocess
import sys

import pytest

from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env


def test_a_row_without_rejected_answer_is_refused_in_one_line(tiny_hf, tmp_path):
    folder, _ = tiny_hf
    data = tmp_path / "prefs.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
                    + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "rlhf", "--model", str(folder), "--dataset",
         str(data), "--output_dir", str(out), "--train_iters", "1", *run_flags()],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=child_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"swift-mcore rlhf: error: --dataset {data}, row 1: no 'rejected' answer "
                     f"(the row has 'prompt', 'chosen'); a preference row has "
                     f"prompt/chosen/rejected, or messages + rejected_response"]
    assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "row 3: a 'messages' row needs 'rejected_response'"),
    ({"messages": [{"role": "user", "content": "a"}], "rejected_response": "c"},
     "row 3: the last message must be the assistant's"),
    ({"rejected": "c"}, "row 3: no 'chosen' answer"),
    ({"prompt": "a", "chosen": 1, "rejected": "c"}, "row 3: 'chosen' must be text"),
    # text and messages in one row: was "'rejected' must be text or ..., got list"
    ({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]},
     "row 3: 'rejected' is a list of messages but 'chosen' is text; a row's prompt and "
     "answers are all text or all message lists"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"},
     "row 3: 'prompt' is a list of messages but 'chosen' is text"),
])
def test_malformed_rows_name_the_row(row, message):
    from swift_mcore.data.preference import to_pair
    from swift_mcore.errors import ArgumentError

    with pytest.raises(ArgumentError, match=message):
        to_pair(row, "--dataset d.jsonl, row 3")


def test_prompts_that_fill_max_length_are_counted_and_refused(tiny_hf):
    from transformers import AutoTokenizer

    from swift_mcore.data.preference import PairReport, encode_pairs, to_pair
    from swift_mcore.errors import ArgumentError

    hf = AutoTokenizer.from_pretrained(str(tiny_hf[0]))
    rows = [{"prompt": "x", "chosen": "y", "rejected": "z"},
            {"prompt": "def add(a, b): " * 8, "chosen": "y", "rejected": "z"},
            {"prompt": "def sub(a, b): " * 8, "chosen": "y", "rejected": "z"}]
    pairs = [to_pair(r, f"--dataset d.jsonl, row {i}") for i, r in enumerate(rows)]
    with pytest.raises(ArgumentError, match=r"^2 of 3 rows have a prompt of --max_length 16 "
                                            r"tokens or more.*\(first: --dataset d.jsonl, "
                                            r"row 1\).*--truncation_mode keep_end"):
        encode_pairs(pairs, hf, 16, "keep_start", PairReport())
    # keep_end keeps the answers' ends: nothing is refused, the long rows are counted as cut
    report = PairReport()
    assert len(encode_pairs(pairs, hf, 16, "keep_end", report)) == 3
    assert report.truncated == 2


@pytest.mark.parametrize("flags, message", [
    (["--loss_type", "sigmoid,dpop"], "--loss_type"),
    (["--loss_type", "sigmoid,ipo", "--loss_weights", "1"],
     "--loss_weights: 1 weights for 2 --loss_type values"),
    (["--loss_type", "exo_pair"], "--loss_type exo_pair needs --label_smoothing > 0"),
    (["--rpo_alpha", "1", "--loss_type", "sft"], "--rpo_alpha adds the 'sft' loss"),
    (["--reference_free", "--ref_model", "x"], "--reference_free trains without a reference"),
    (["--max_length", "100"], "--max_length 100 exceeds --seq_length 64 \\+ 1"),
    # one token trains no position: megatron's attention raised on the empty rows
    (["--max_length", "1", "--truncation_mode", "keep_end"],
     "^--max_length 1: a sequence of n tokens trains n - 1 positions"),
    (["--rlhf_type", "kto", "--max_length", "1"], "^--max_length 1: a sequence of n tokens"),
    (["--rlhf_type", "ppo"], "--rlhf_type"),
    # no validation data: it evaluated nothing, silently
    (["--eval_steps", "5"], "^--eval_steps 5: rlhf has no validation data yet"),
    (["--rlhf_type", "kto", "--rpo_alpha", "1"], "^--rpo_alpha is a DPO flag; --rlhf_type kto"),
    (["--rlhf_type", "kto", "--loss_type", "ipo"],
     "^--loss_type ipo: --rlhf_type kto takes one of TRL's KTO losses: kto, "
     "apo_zero_unpaired$"),
    (["--rlhf_type", "kto", "--loss_type", "kto,apo_zero_unpaired"],
     "^--loss_type kto,apo_zero_unpaired: --rlhf_type kto takes one of"),
    (["--loss_type", "apo_zero_unpaired"],
     "^--loss_type apo_zero_unpaired is a KTO loss; it needs --rlhf_type kto$"),
    (["--rlhf_type", "simpo", "--loss_type", "kto"], "^--loss_type kto is a KTO loss"),
    (["--rlhf_type", "kto", "--reference_free"], "^--reference_free is a DPO flag"),
    (["--rlhf_type", "kto", "--micro_batch_size", "1"],
     "^--rlhf_type kto needs --micro_batch_size 2 or more"),
    (["--desirable_weight", "2"], "^--desirable_weight weighs KTO's losses; it needs "
                                  "--rlhf_type kto"),
    (["--load", ".", "--finetune"], "rlhf --load: the reference would not be the loaded weights"),
    (["--rlhf_type", "orpo", "--ref_model", "x"],
     "^--ref_model: --rlhf_type orpo is reference-free \\(no reference model is loaded\\)"),
    (["--rlhf_type", "simpo", "--ref_model", "x"], "^--ref_model: --rlhf_type simpo is "),
    (["--rlhf_type", "orpo", "--reference_free"],
     "^--reference_free does not apply to --rlhf_type orpo"),
    (["--rlhf_type", "simpo", "--loss_type", "ipo"],
     "^--loss_type does not apply to --rlhf_type simpo"),
    (["--rlhf_type", "orpo", "--rpo_alpha", "1"], "^--rpo_alpha does not apply to --rlhf_type"),
    (["--rlhf_type", "orpo", "--label_smoothing", "0.1"], "^--label_smoothing does not apply"),
    (["--rlhf_type", "orpo", "--simpo_gamma", "1"], "^--simpo_gamma does not apply"),
    (["--rlhf_type", "orpo", "--cpo_alpha", "1"], "^--cpo_alpha does not apply"),
    (["--rlhf_type", "simpo", "--truncation_mode", "keep_end"],
     "^--truncation_mode keep_end: --rlhf_type simpo cuts the answer"),
    (["--simpo_gamma", "1"], "^--simpo_gamma is a SimPO flag; it needs --rlhf_type simpo"),
    (["--rlhf_type", "kto", "--cpo_alpha", "1"], "^--cpo_alpha is a SimPO flag"),
    (["--rlhf_type", "simpo", "--simpo_gamma", "-1"], "--simpo_gamma"),
    (["--precompute_ref_log_probs", "--reference_free"],
     "^--precompute_ref_log_probs computes the reference's log-probabilities; "
     "--reference_free has no reference"),
    (["--rlhf_type", "kto", "--precompute_ref_log_probs"],
     "^--precompute_ref_log_probs is a DPO flag; --rlhf_type kto"),
    (["--rlhf_type", "orpo", "--precompute_ref_log_probs"],
     "^--precompute_ref_log_probs does not apply to --rlhf_type orpo"),
    # flags the chosen loss never reads would change nothing, silently
    (["--label_smoothing", "0.1"], "^--label_smoothing 0.1 changes only the robust, exo_pair, "
                                   "aot, aot_unpaired losses; --loss_type sigmoid ignores it"),
    (["--loss_type", "ipo,hinge", "--label_smoothing", "0.2"],
     "--loss_type ipo,hinge ignores it"),
    (["--discopop_tau", "0.5"], "^--discopop_tau is the discopop loss's temperature; "
                                "--loss_type sigmoid does not read it$"),
    (["--loss_type", "sigmoid,sft", "--loss_weights", "1,-0.5"],
     "^--loss_weights: -0.5 for --loss_type sft; a weight is >= 0"),
    (["--loss_type", "sigmoid,ipo", "--loss_weights", "0,0"],
     "^--loss_weights: every weight is 0"),
    (["--rlhf_type", "kto", "--desirable_weight", "0", "--undesirable_weight", "0"],
     "^--desirable_weight 0 and --undesirable_weight 0: the loss is 0"),
])
def test_bad_flags_are_refused_naming_the_flag(flags, message, tmp_path):
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    argv = ["--dataset", str(data), "--output_dir", str(tmp_path / "o"), *run_flags(*flags)]
    with pytest.raises(ArgumentError, match=message):
        resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments), world_size=1)


def test_pipeline_with_sequence_parallel_needs_a_seq_length_the_ranks_split(tmp_path):
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    argv = ["--dataset", str(data), "--output_dir", str(tmp_path / "o"),
            *run_flags("--seq_length", "63", "--pipeline_model_parallel_size", "2",
                       "--tensor_model_parallel_size", "2", "--sequence_parallel",
                       "--num_layers", "2", "--global_batch_size", "8")]
    with pytest.raises(ArgumentError, match=r"^--seq_length 63 with --sequence_parallel and "
                                            r"--pipeline_model_parallel_size 2: .* give a "
                                            r"multiple of 2$"):
        resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments), world_size=4)


def test_apo_zero_unpaired_takes_one_row_micro_batches(tmp_path):
    """KTO's micro-batch of one is refused for its KL rows; apo_zero_unpaired has none."""
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.run_config import resolve

    data = tmp_path / "k.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b", "label": True}) + "\n")
    argv = ["--dataset", str(data), "--output_dir", str(tmp_path / "o"), "--rlhf_type", "kto",
            "--loss_type", "apo_zero_unpaired", *run_flags("--micro_batch_size", "1")]
    config = resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments),
                     world_size=1)
    assert config.rlhf.kto_loss_type() == "apo_zero_unpaired"


def test_the_memory_estimate_counts_the_reference_copy_but_not_with_lora(tmp_path):
    from swift_mcore.arguments import RlhfArguments, SftArguments
    from swift_mcore.models import footprint

    def reference_bytes(cls, **flags):
        args = cls.from_flags(num_layers=2, hidden_size=64, num_attention_heads=4,
                              vocab_size=320, **flags)
        args.fill_defaults()
        found = {p.name: p for p in footprint.parts(args, 1, "fp32", weights_only=False)}
        return found.get("reference model"), found

    ref, found = reference_bytes(RlhfArguments)
    weights = sum(p.bytes // footprint.TRAINED_BYTES * 4 for name, p in found.items()
                  if name in ("embedding", "output layer", "layers"))
    assert ref is not None and ref.bytes == weights and ref.parameters == 0
    assert reference_bytes(RlhfArguments, tuner_type="lora")[0] is None
    assert reference_bytes(RlhfArguments, tuner_type="lora", ref_model=str(tmp_path))[0]
    assert reference_bytes(RlhfArguments, reference_free=True)[0] is None
    assert reference_bytes(RlhfArguments, rlhf_type="orpo")[0] is None
    assert reference_bytes(RlhfArguments, rlhf_type="simpo")[0] is None
    assert reference_bytes(RlhfArguments, rlhf_type="rm")[0] is None  # no reference either
    assert reference_bytes(SftArguments)[0] is None


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 400}, "it has lm_head.weight of shape \\[400, 64\\], the policy \\[320, 64\\]"),
    ({"num_hidden_layers": 3}, "it has model.layers.2.input_layernorm.weight of shape \\[64\\], "
                               "the policy none"),
])
def test_a_reference_of_another_architecture_or_vocabulary_is_refused(tiny_hf, tmp_path,
                                                                      change, message):
    import hf_helpers as H
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.errors import ArgumentError
    from swift_mcore.data.tokenizer import load_tokenizer
    from swift_mcore.run_config import resolve
    from swift_mcore.training.rlhf_trainer import check_reference_folder

    folder, data = tiny_hf
    other = tmp_path / "other"
    H.make_model(str(other), "llama", tokenizer=False, **change)
    argv = ["--model", str(folder), "--ref_model", str(other), "--dataset", str(data),
            "--output_dir", str(tmp_path / "o"), *run_flags()]
    same = argv[:2] + ["--ref_model", str(folder)] + argv[4:]
    tokenizer = load_tokenizer(str(folder), flag="--model")
    check_reference_folder(resolve(parse_args(same, prog="swift-mcore rlhf", cls=RlhfArguments),
                                   world_size=1), tokenizer)  # the policy's own folder passes
    config = resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments), world_size=1)
    with pytest.raises(ArgumentError, match=f"^--ref_model {other}: not the policy's "
                                            f"architecture and vocabulary: {message}$"):
        check_reference_folder(config, tokenizer)


def test_a_reference_with_another_tokenizer_is_refused(tiny_hf, tmp_path):
    """Same shapes, other tokenizer: the reference would score other text (it ran before)."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    import hf_helpers as H
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.errors import ArgumentError
    from swift_mcore.data.tokenizer import load_tokenizer
    from swift_mcore.run_config import resolve
    from swift_mcore.training.rlhf_trainer import check_reference_folder

    folder, data = tiny_hf
    other, untokenized = tmp_path / "other", tmp_path / "weights_only"
    H.make_model(str(other), "llama", seed=1, tokenizer=False)
    shutil.copytree(other, untokenized)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(["the quick brown fox\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[H.EOD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=H.EOD).save_pretrained(other)
    tokenizer = load_tokenizer(str(folder), flag="--model")

    def config(reference):
        argv = ["--model", str(folder), "--ref_model", str(reference), "--dataset", str(data),
                "--output_dir", str(tmp_path / "o"), *run_flags()]
        return resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments),
                       world_size=1)

    check_reference_folder(config(untokenized), tokenizer)  # no tokenizer: taken as the same
    with pytest.raises(ArgumentError, match=f"^--ref_model {other}: its tokenizer is not the "
                                            f"policy's \\({folder}\\)"):
        check_reference_folder(config(other), tokenizer)


def test_loss_weights_take_the_documented_comma_form(tmp_path):
    """docs/rlhf.md's `--loss_type sigmoid,sft --loss_weights 1,0.2` was refused."""
    from swift_mcore.arguments import RlhfArguments, parse_args

    args = parse_args(["--dataset", "d.jsonl", "--loss_type", "sigmoid,sft",
                       "--loss_weights", "1,0.2"], prog="swift-mcore rlhf", cls=RlhfArguments)
    assert args.rlhf.loss_weights == [1.0, 0.2]


@pytest.mark.parametrize("task", ["dpo", "orpo", "rm", "kto"])
def test_messages_without_a_chat_template_are_refused_naming_the_row(tiny_hf, task):
    """The tiny tokenizer has no chat template: transformers' ValueError traceback before."""
    from transformers import AutoTokenizer

    from swift_mcore.data.preference import to_pair, tokenize_pair, tokenize_pair_per_answer
    from swift_mcore.data.reward_pairs import tokenize_reward_pair
    from swift_mcore.data.unpaired import to_unpaired, tokenize_unpaired
    from swift_mcore.errors import ArgumentError

    hf = AutoTokenizer.from_pretrained(str(tiny_hf[0]))
    assert not hf.chat_template
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
           "rejected_response": "c"}
    where = "--dataset d.jsonl, row 2"
    tokenize, item = {"dpo": (tokenize_pair, to_pair), "orpo": (tokenize_pair_per_answer, to_pair),
                      "rm": (tokenize_reward_pair, to_pair),
                      "kto": (tokenize_unpaired, lambda r, w: to_unpaired(r, w)[0])}[task]
    with pytest.raises(ArgumentError, match=f"^{where}: its messages are rendered with the "
                                            f"tokenizer's chat template, and the tokenizer of "
                                            f".* has none; give the rows as text"):
        tokenize(item(row, where), hf)


@pytest.mark.parametrize("row", [
    {"prompt": "a", "chosen": "b", "rejected": "c", "images": ["x.png"]},
    {"prompt": "a", "completion": "b", "label": True, "videos": ["x.mp4"]},
])
def test_rows_with_media_are_refused_not_trained_as_text(row):
    """A text model trained on the text alone would drop the images without a word."""
    from swift_mcore.data.preference import to_pair
    from swift_mcore.data.unpaired import to_unpaired
    from swift_mcore.errors import ArgumentError

    read = to_unpaired if "label" in row else to_pair
    column = "images" if "images" in row else "videos"
    with pytest.raises(ArgumentError, match=f"^--dataset d.jsonl, row 0: column '{column}' "
                                            f"holds {column}"):
        read(row, "--dataset d.jsonl, row 0")


@pytest.mark.parametrize("row", [
    {"messages": [{"role": "assistant", "content": "b"}], "rejected_response": "c"},
    {"chosen": [{"role": "assistant", "content": "b"}],  # implicit prompt: no common start
     "rejected": [{"role": "assistant", "content": "c"}]},
])
def test_a_conversation_without_a_prompt_turn_is_refused_where_the_prompt_is_rendered(
        tiny_hf, row):
    """dpo, orpo/simpo and kto render the prompt alone: transformers raised "Cannot apply
    chat template to an empty conversation". A reward model renders prompt + answer whole,
    as TRL's RewardTrainer: such a row is fine there."""
    from transformers import AutoTokenizer

    from swift_mcore.data.preference import to_pair, tokenize_pair, tokenize_pair_per_answer
    from swift_mcore.data.reward_pairs import tokenize_reward_pair
    from swift_mcore.data.unpaired import to_unpaired, tokenize_unpaired
    from swift_mcore.errors import ArgumentError

    hf = AutoTokenizer.from_pretrained(str(tiny_hf[0]))
    hf.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    where = "--dataset d.jsonl, row 4"
    pair = to_pair(row, where)
    for tokenize, item in ((tokenize_pair, pair), (tokenize_pair_per_answer, pair),
                           (tokenize_unpaired, to_unpaired(row, where)[1])):
        with pytest.raises(ArgumentError, match=f"^{where}: no message before the answer"):
            tokenize(item, hf)
    chosen, rejected = tokenize_reward_pair(pair, hf)
    assert hf.decode(chosen) == "assistant: b\n" and hf.decode(rejected) == "assistant: c\n"


@pytest.mark.parametrize("family, change, message", [
    ("llama", {"rope_theta": 1e6}, "its config.json is not the policy's architecture: "
                                   "rotary_base 1000000 \\(the policy 10000\\)"),
    ("llama", {"rms_norm_eps": 0.5}, "its config.json is not the policy's architecture: "
                                     "norm_epsilon 0.5 \\(the policy 1e-06\\)"),
    ("mistral", {}, "a mistral model, the policy a llama one"),
])
def test_a_reference_of_the_same_shapes_but_another_config_is_refused(tiny_hf, tmp_path,
                                                                      family, change, message):
    """The reference runs in the policy's architecture: these trained against a reference
    computed with the policy's rope base, norm epsilon, family (silently, before)."""
    import hf_helpers as H
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.data.tokenizer import load_tokenizer
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve
    from swift_mcore.training.rlhf_trainer import check_reference_folder

    folder, data = tiny_hf
    other = tmp_path / "other"
    H.make_family(str(other), family, tokenizer=False, seed=1, **change)
    argv = ["--model", str(folder), "--ref_model", str(other), "--dataset", str(data),
            "--output_dir", str(tmp_path / "o"), *run_flags()]
    config = resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments), world_size=1)
    with pytest.raises(ArgumentError, match=f"^--ref_model {other}: {message}"):
        check_reference_folder(config, load_tokenizer(str(folder), flag="--model"))


def test_an_answer_nothing_predicts_is_refused_for_orpo_and_simpo(tiny_hf):
    """Empty prompt, no BOS, answer '' (just the EOS): no answer token is predicted, so its
    mean log-probability is 0/0; orpo's gradient was nan (iteration 1 stopped)."""
    from transformers import AutoTokenizer

    from swift_mcore.data.preference import PairReport, encode_pairs, to_pair
    from swift_mcore.errors import ArgumentError

    hf = AutoTokenizer.from_pretrained(str(tiny_hf[0]))
    assert hf.bos_token_id is None
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"},
            {"prompt": "", "chosen": " x", "rejected": ""}]
    pairs = [to_pair(r, f"--dataset d.jsonl, row {i}") for i, r in enumerate(rows)]
    with pytest.raises(ArgumentError, match="^--dataset d.jsonl, row 1: the rejected answer "
                                            "has no token the model predicts"):
        encode_pairs(pairs, hf, 64, "keep_start", PairReport(), per_answer=True)
    # dpo sums the log-probabilities: an empty sum is 0, as TRL's
    assert len(encode_pairs(pairs, hf, 64, "keep_start", PairReport())) == 2


def test_a_nonfinite_stop_names_beta_among_the_flags_to_lower(tmp_path):
    """--beta 1e30 overflows the first step's gradient whatever --lr is; the stop message
    told the user to lower --lr only."""
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.errors import NonFiniteError
    from swift_mcore.run_config import resolve
    from swift_mcore.training.nonfinite import NonFiniteGuard

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    argv = ["--dataset", str(data), "--output_dir", str(tmp_path / "o"),
            *run_flags("--beta", "1e30")]
    config = resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments), world_size=1)
    guard = NonFiniteGuard.for_config(config, log=lambda line: None)
    with pytest.raises(NonFiniteError, match=r"Lower --lr or --beta 1e\+30 \(or check the "
                                             r"data\), or pass --nonfinite_policy skip"):
        guard.refuse(1, "the gradient norm is inf (the loss is finite)")


def test_trl_columns_win_over_a_messages_column_beside_them():
    """HuggingFaceH4/ultrafeedback_binarized's rows: a text 'prompt', conversations 'chosen'
    and 'rejected' that hold it, and 'messages' (prompt + chosen). They were refused ("a
    'messages' row needs 'rejected_response'"); TRL's maybe_extract_prompt reads them."""
    from swift_mcore.data.preference import to_pair
    from swift_mcore.data.unpaired import to_unpaired
    from swift_mcore.errors import ArgumentError

    user = {"role": "user", "content": "Sky color?"}
    good, bad = ({"role": "assistant", "content": c} for c in ("blue", "green"))
    row = {"prompt": "Sky color?", "chosen": [user, good], "rejected": [user, bad],
           "messages": [user, good], "score_chosen": 8.0}
    pair = to_pair(row, "--dataset d.jsonl, row 0")
    assert (pair.prompt, pair.chosen, pair.rejected) == ([user], [good], [bad])
    with pytest.raises(ArgumentError, match="^--dataset d.jsonl, row 0: both TRL's 'chosen'/"
                                            "'rejected' and ms-swift's 'rejected_response'"):
        to_pair({**row, "rejected_response": "green"}, "--dataset d.jsonl, row 0")
    kto = to_unpaired({"prompt": [user], "completion": [bad], "label": False,
                       "messages": [user, good]}, "--dataset d.jsonl, row 0")
    assert [(u.prompt, u.completion, u.desirable) for u in kto] == [([user], [bad], False)]


@pytest.mark.parametrize("task", ["dpo", "orpo", "rm", "kto"])
def test_a_row_the_chat_template_refuses_is_named(tiny_hf, task):
    """A template that raises (as Llama's and Mistral's do on roles out of order) gave
    jinja2's TemplateError as a traceback; a 'tools' that is no list, a TypeError."""
    from transformers import AutoTokenizer

    from swift_mcore.data.preference import PairReport, encode_pairs, to_pair
    from swift_mcore.data.reward_pairs import encode_reward_pairs
    from swift_mcore.data.unpaired import UnpairedReport, encode_unpaired, to_unpaired
    from swift_mcore.errors import ArgumentError

    hf = AutoTokenizer.from_pretrained(str(tiny_hf[0]))
    hf.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                        "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
                        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    row = {"prompt": [{"role": "wizard", "content": "a"}],
           "chosen": [{"role": "assistant", "content": "b"}],
           "rejected": [{"role": "assistant", "content": "c"}]}
    where = "--dataset d.jsonl, row 5"
    encode = {
        "dpo": lambda: encode_pairs([to_pair(row, where)], hf, 64, "keep_start", PairReport()),
        "orpo": lambda: encode_pairs([to_pair(row, where)], hf, 64, "keep_start", PairReport(),
                                     per_answer=True),
        "rm": lambda: encode_reward_pairs([to_pair(row, where)], hf, 64),
        "kto": lambda: encode_unpaired(to_unpaired(row, where), hf, 64, "keep_start",
                                       UnpairedReport())}[task]
    with pytest.raises(ArgumentError, match=f"^{where}: the tokenizer's chat template cannot "
                                            f"render it: roles must be user or assistant$"):
        encode()
    read = to_unpaired if task == "kto" else to_pair
    with pytest.raises(ArgumentError, match=f"^{where}: 'tools' must be a list of tool "
                                            f"schemas \\(JSON objects\\), got 5$"):
        read({**row, "tools": "5"}, where)
