"""`infer` and the model's context: with learned position embeddings a prompt that leaves
no room for --max_new_tokens is an error naming the flag and the context length (it used to
print the prompt and nothing else, or stop early without a word); past the trained length
of RoPE positions it is a warning. What infer streams is the tokens' decoding, a character
split over tokens included."""

import pytest

from run_helpers import run_pt

PROMPT_WORDS = "def add(a, b): return a + b"


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A checkpoint of a model with learned absolute positions, 32 of them."""
    out = tmp_path_factory.mktemp("learned") / "run"
    run_pt(out, "--train_iters", "1", "--position_embedding_type", "learned_absolute")
    return str(out)


def prompt_tokens(text):
    from swift_mcore.data.tokenizer import default_tokenizer

    return len(default_tokenizer().hf(text)["input_ids"])  # as infer tokenizes it


def infer_error(capsys, *argv):
    from swift_mcore.cli import main

    capsys.readouterr()
    code = main(["infer", *map(str, argv)])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and captured.err.strip().splitlines()[-1] == errors[0]
    assert errors[0].startswith("swift-mcore infer: error: ")
    assert "Traceback" not in captured.err and captured.out == ""  # not even the prompt
    return errors[0]


def test_prompt_as_long_as_the_context_is_an_error(learned, gloo_group, capsys):
    prompt = " ".join([PROMPT_WORDS] * 6)
    n = prompt_tokens(prompt)
    assert n >= 32
    line = infer_error(capsys, "--model", learned, "--prompt", prompt)
    assert f"--prompt is {n} tokens" in line and "32 positions (max_position_embeddings)" \
                                                 in line, line


def test_prompt_and_max_new_tokens_past_the_context_is_an_error(learned, gloo_group, capsys):
    n = prompt_tokens(PROMPT_WORDS)
    assert n < 32
    line = infer_error(capsys, "--model", learned, "--prompt", PROMPT_WORDS,
                       "--max_new_tokens", 64)
    assert "--max_new_tokens 64" in line and f"pass --max_new_tokens {32 - n} or less" in line


def test_what_fits_is_generated_in_full(learned, gloo_group, capsys):
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.infer import run

    n = prompt_tokens(PROMPT_WORDS)
    run(InferArguments(model=learned, prompt=PROMPT_WORDS, max_new_tokens=32 - n).validate())
    captured = capsys.readouterr()
    assert captured.out.startswith(PROMPT_WORDS) and "WARNING" not in captured.err


def test_rope_past_max_position_embeddings_warns():
    from swift_mcore.errors import ArgumentError
    from swift_mcore.infer import check_context

    said = []
    check_context(20, 12, 32, "rope", said.append)
    assert said == []
    check_context(20, 64, 32, "rope", said.append)
    assert len(said) == 1 and said[0].startswith("WARNING: ") and "(32)" in said[0]
    with pytest.raises(ArgumentError, match=r"--max_new_tokens 13: .*pass --max_new_tokens "
                                            r"12 or less"):
        check_context(20, 13, 32, "learned_absolute", said.append)
    with pytest.raises(ArgumentError, match=r"--prompt is 32 tokens"):
        check_context(32, 1, 32, "learned_absolute", said.append)


@pytest.mark.parametrize("pieces, printed", [
    (["\u00c3", "\u00a9"], "\u00e9"),  # é's two bytes in two tokens
    (["x", "\u00c3"], "x\ufffd"),  # a first byte no token completes: as decode gives it
], ids=["completed", "left-incomplete"])
def test_a_character_split_over_tokens_prints_as_the_tokens_decode(
        learned, gloo_group, capsys, monkeypatch, pieces, printed):
    """A character whose bytes span tokens is printed once whole (its first token alone
    decodes as U+FFFD, which was printed and never taken back: the text differed from the
    tokens' decoding)."""
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.data.tokenizer import default_tokenizer
    from swift_mcore.infer import run
    from swift_mcore.models import generate

    ids = default_tokenizer().hf.convert_tokens_to_ids(pieces)  # byte-level tokens
    monkeypatch.setattr(generate, "generate", lambda *args, **kwargs: iter(ids))
    capsys.readouterr()
    text = run(InferArguments(model=learned, prompt="say", max_new_tokens=2).validate())
    assert text == printed and capsys.readouterr().out == "say" + printed + "\n"
