"""Chat templates: exact token ids and per-token answer turns for the built-in templates and a
tokenizer's own chat template; prompts, answer markers, and the errors of unusable templates.

Expected ids are built here from literal text pieces (not from the template's own format
strings): the whole text tokenized at once, as Hugging Face tokenizes a rendered chat, and
each token's turn found by decoding the ids one by one (a token that takes in answer text is
the answer's). Any change in rendering or in where an answer starts or ends fails a
whole-array comparison.
"""

import numpy as np
import pytest

from swift_mcore.errors import ArgumentError
from swift_mcore.data.templates import CONTEXT, Template, has_chatml_tokens

EOD = object()  # stands for the tokenizer's end-of-document token in a list of pieces

# A small Jinja chat template: a growing prefix, the answer closed by eos_token and a newline.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}System: {{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}")

# Templates that rewrite what they rendered earlier once the conversation grows: one counts
# the messages up front, one hides earlier answers (as reasoning models' templates do).
COUNTING_TEMPLATE = "{{ messages|length }} messages\n" + CHAT_TEMPLATE
HIDING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% elif loop.last %}Assistant: {{ m['content'] }}\n"
    "{% else %}Assistant: (earlier answer)\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}")

SINGLE = [{"role": "user", "content": "What is 2+2?"},
          {"role": "assistant", "content": "It is 4."}]
MULTI = [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Hi there"},
         {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Name a color."},
         {"role": "assistant", "content": "Blue."}]


@pytest.fixture(scope="module")
def tok():
    from swift_mcore.data import default_tokenizer

    return default_tokenizer()


def with_chat_template(template):
    """A fresh default tokenizer (its own HF object) carrying ``template``."""
    from swift_mcore.data import default_tokenizer
    from swift_mcore.data.tokenizer import Tokenizer

    base = default_tokenizer()
    hf = base.hf
    hf.chat_template = template
    return Tokenizer("test-chat-tokenizer", hf=hf, eod=base.eod, pad=base.pad)


@pytest.fixture(scope="module")
def chat_tok():
    return with_chat_template(CHAT_TEMPLATE)


def expected(tokenizer, pieces):
    """(ids, turns) from (text or EOD, turn) pieces: the concatenated text tokenized whole;
    a token's turn is the highest turn among the pieces its characters fall in."""
    eod_text = tokenizer.decode([tokenizer.eod])
    text, spans = "", []
    for piece, turn in pieces:
        piece = eod_text if piece is EOD else piece
        spans.append((len(text), len(text) + len(piece), turn))
        text += piece
    ids = tokenizer.encode(text)
    turns, start = [], 0
    for k in range(len(ids)):
        end = len(tokenizer.decode(ids[:k + 1]))
        turns.append(max(t for s, e, t in spans if s < max(end, start + 1) and e > start))
        start = end
    assert tokenizer.decode(ids) == text
    return np.asarray(ids, np.int32), np.asarray(turns, np.int32)


def assert_encodes(template, messages, want):
    ids, turns = template.encode(messages)
    want_ids, want_turns = want
    assert ids.dtype == np.int32 and turns.dtype == np.int32
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(turns, want_turns)
    return ids, turns


# ---- built-in templates -----------------------------------------------------------------

def test_chatml_single_turn(tok):
    ids, turns = assert_encodes(Template("chatml", tok), SINGLE, expected(tok, [
        ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", CONTEXT),
        ("It is 4.<|im_end|>", 0), (EOD, 0)]))
    context = len(tok.encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                             "<|im_start|>assistant\n"))
    # The answer is exactly the tail, from its first token through the EOD.
    np.testing.assert_array_equal(np.flatnonzero(turns != CONTEXT),
                                  np.arange(context, len(ids)))
    assert ids[-1] == tok.eod and (ids == tok.eod).sum() == 1
    assert tok.decode(ids[context:]) == "It is 4.<|im_end|><|endoftext|>"


def test_chatml_multi_turn_with_system(tok):
    assert_encodes(Template("chatml", tok), MULTI, expected(tok, [
        ("<|im_start|>system\nYou are terse.<|im_end|>\n", CONTEXT),
        ("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", CONTEXT),
        ("Hello!<|im_end|>", 0), (EOD, 0),
        ("\n", CONTEXT),  # the separator after an answer is context
        ("<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n", CONTEXT),
        ("Blue.<|im_end|>", 1), (EOD, 1)]))


def test_plain_single_turn(tok):
    ids, turns = assert_encodes(Template("plain", tok), SINGLE, expected(tok, [
        ("### User:\nWhat is 2+2?\n\n### Assistant:\n", CONTEXT), ("It is 4.", 0), (EOD, 0)]))
    assert tok.decode(ids) == "### User:\nWhat is 2+2?\n\n### Assistant:\nIt is 4.<|endoftext|>"


def test_plain_multi_turn_with_system(tok):
    assert_encodes(Template("plain", tok), MULTI, expected(tok, [
        ("You are terse.\n\n", CONTEXT),
        ("### User:\nHi there\n\n### Assistant:\n", CONTEXT),
        ("Hello!", 0), (EOD, 0),
        ("\n\n", CONTEXT),
        ("### User:\nName a color.\n\n### Assistant:\n", CONTEXT),
        ("Blue.", 1), (EOD, 1)]))


def test_every_answer_ends_with_one_trained_eod(tok):
    for name in ("chatml", "plain"):
        ids, turns = Template(name, tok).encode(MULTI)
        eods = np.flatnonzero(ids == tok.eod)
        assert len(eods) == 2
        for turn, at in enumerate(eods):
            assert turns[at] == turn  # trained on, as part of its answer
            last_of_turn = np.flatnonzero(turns == turn)[-1]
            assert at == last_of_turn


def test_empty_answer_still_trains_its_eod(tok):
    messages = [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]
    assert_encodes(Template("plain", tok), messages, expected(tok, [
        ("### User:\nSay nothing.\n\n### Assistant:\n", CONTEXT), (EOD, 0)]))


def test_default_system_prompt(tok):
    for name in ("chatml", "plain"):
        with_default = Template(name, tok, system="You are terse.")
        plain = Template(name, tok)
        no_system = MULTI[1:]
        for got, want in zip(with_default.encode(no_system), plain.encode(MULTI)):
            np.testing.assert_array_equal(got, want)
        # A conversation's own system message wins over the default.
        own = [{"role": "system", "content": "Be verbose."}, *no_system]
        for got, want in zip(with_default.encode(own), plain.encode(own)):
            np.testing.assert_array_equal(got, want)
        assert "You are terse." not in tok.decode(with_default.encode(own)[0])


def test_chatml_markers_as_single_tokens_and_auto():
    """With <|im_start|>/<|im_end|> in the vocabulary, auto picks chatml; when <|im_end|> is
    the EOD itself, an answer ends with it once, not followed by a second EOD."""
    from swift_mcore.data import default_tokenizer
    from swift_mcore.data.tokenizer import Tokenizer

    base = default_tokenizer()
    hf = base.hf
    hf.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    start, end = hf.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    with_markers = Tokenizer("markers", hf=hf, eod=base.eod, pad=base.pad)
    assert has_chatml_tokens(with_markers)
    template = Template("auto", with_markers)
    assert template.name == "chatml"
    ids, turns = assert_encodes(template, SINGLE, expected(with_markers, [
        ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", CONTEXT),
        ("It is 4.<|im_end|>", 0), (EOD, 0)]))
    assert ids[0] == start and ids[-2:].tolist() == [end, base.eod]

    im_end_is_eod = Tokenizer("markers-eod", hf=hf, eod=end, pad=base.pad)
    ids, turns = Template("chatml", im_end_is_eod).encode(SINGLE)
    answer = with_markers.encode("It is 4.<|im_end|>")
    assert ids[-len(answer):].tolist() == answer and answer[-1] == end
    assert (ids == end).sum() == 2  # the user's <|im_end|> and the answer's; no extra one
    assert turns[-1] == 0 and turns[-len(answer) - 1] == CONTEXT


def test_auto_without_chat_template_or_markers_is_plain(tok):
    assert not has_chatml_tokens(tok)
    assert Template("auto", tok).name == "plain"


def test_prompt_is_the_context_and_ends_with_the_cue(tok):
    cues = {"chatml": "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n",
            "plain": "### User:\nName a color.\n\n### Assistant:\n"}
    for name, cue in cues.items():
        template = Template(name, tok)
        ids, turns = template.encode(MULTI)
        last_answer = np.flatnonzero(turns == 1)[0]
        prompt = template.prompt(MULTI[:-1])
        assert prompt == ids[:last_answer].tolist()
        assert tok.decode(prompt).endswith(cue)
        first_answer = np.flatnonzero(turns == 0)[0]
        assert template.prompt(MULTI[:2]) == ids[:first_answer].tolist()
    # --system applies to prompts as to training conversations.
    template = Template("plain", tok, system="You are terse.")
    assert template.prompt(MULTI[1:2]) == Template("plain", tok).prompt(MULTI[:2])


def test_answer_text_strips_the_end_marker(tok, chat_tok):
    assert Template("chatml", tok).answer_text("Blue.<|im_end|>") == "Blue."
    assert Template("chatml", tok).answer_text("Blue.") == "Blue."
    assert Template("plain", tok).answer_text("Blue.<|im_end|>") == "Blue.<|im_end|>"
    assert Template("tokenizer", chat_tok).answer_text("Blue.\n") == "Blue.\n"


def test_unknown_template_names_the_choices(tok):
    with pytest.raises(ArgumentError, match=r"--template nope: no such template; choose auto, "
                                            r"tokenizer, chatml, plain"):
        Template("nope", tok)


def test_tokenizer_template_without_one_is_refused(tok):
    with pytest.raises(ArgumentError) as err:
        Template("tokenizer", tok)
    message = str(err.value)
    assert "--template tokenizer" in message and "has no chat template" in message
    assert tok.source in message and "--template chatml or plain" in message


# ---- the tokenizer's own chat template ----------------------------------------------------

def test_tokenizer_template_single_turn(chat_tok):
    template = Template("auto", chat_tok)
    assert template.name == "tokenizer"
    ids, turns = assert_encodes(template, SINGLE, expected(chat_tok, [
        ("User: What is 2+2?\nAssistant: ", CONTEXT), ("It is 4.<|endoftext|>", 0),
        ("\n", CONTEXT)]))  # the newline after the end marker is the next message's start
    assert ids[-2] == chat_tok.eod and turns[-2] == 0  # the template's eos_token is trained
    assert (ids == chat_tok.eod).sum() == 1  # and no second EOD is added after the newline
    # The prompt is what HF tokenizes from the rendered generation prompt: this template's
    # cue ends with a space, a token of its own there, while training merged it into " It".
    prompt = template.prompt(SINGLE[:1])
    assert prompt[:-1] == ids[:np.flatnonzero(turns == 0)[0]].tolist()
    assert chat_tok.decode(prompt) == "User: What is 2+2?\nAssistant: "


def test_tokenizer_template_multi_turn_with_system(chat_tok):
    template = Template("tokenizer", chat_tok)
    assert_encodes(template, MULTI, expected(chat_tok, [
        ("System: You are terse.\nUser: Hi there\nAssistant: ", CONTEXT),
        ("Hello!<|endoftext|>", 0),
        ("\nUser: Name a color.\nAssistant: ", CONTEXT),
        ("Blue.<|endoftext|>", 1), ("\n", CONTEXT)]))
    # The prompt of a follow-up is tokenized as in training: the earlier answer keeps its
    # trained tokens.
    ids, turns = template.encode(MULTI)
    prompt = template.prompt(MULTI[:-1])
    assert prompt[:-1] == ids[:np.flatnonzero(turns == 1)[0]].tolist()  # but the cue's space
    assert chat_tok.decode(prompt).endswith("User: Name a color.\nAssistant: ")
    # A trailing user message (no answer) renders as context.
    ids, turns = template.encode(MULTI[:4])
    want_ids, want_turns = expected(chat_tok, [
        ("System: You are terse.\nUser: Hi there\nAssistant: ", CONTEXT),
        ("Hello!<|endoftext|>", 0), ("\nUser: Name a color.\n", CONTEXT)])
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(turns, want_turns)


def test_ids_are_what_hugging_face_tokenizes_from_the_rendered_chat(chat_tok):
    """Training sees the ids a user's apply_chat_template + tokenizer gives at inference,
    including tokens that straddle the cue and the answer (" It" after "Assistant:")."""
    template = Template("tokenizer", chat_tok)
    ids, turns = template.encode(MULTI)
    hf_ids = chat_tok.hf(chat_tok.hf.apply_chat_template(MULTI, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    assert ids.tolist() == hf_ids
    at = np.flatnonzero(turns == 0)[0]
    # the answer's first token carries the cue's space and is trained
    assert chat_tok.decode([ids[at]]).startswith(" H") and turns[at - 1] == CONTEXT
    assert chat_tok.decode(ids[:at]).endswith("Assistant:")
    prompt = template.prompt(MULTI[:2])
    assert prompt == chat_tok.hf(chat_tok.hf.apply_chat_template(
        MULTI[:2], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)["input_ids"]


def test_tokenizer_template_default_system(chat_tok):
    with_default = Template("tokenizer", chat_tok, system="You are terse.")
    for got, want in zip(with_default.encode(MULTI[1:]),
                         Template("tokenizer", chat_tok).encode(MULTI)):
        np.testing.assert_array_equal(got, want)
    assert chat_tok.decode(with_default.prompt(MULTI[1:2])) == (
        "System: You are terse.\nUser: Hi there\nAssistant: ")


def test_tokenizer_template_loaded_from_a_folder(chat_tok, tmp_path):
    from swift_mcore.data.tokenizer import load_tokenizer

    chat_tok.save_pretrained(str(tmp_path / "tok"))
    loaded = load_tokenizer(str(tmp_path / "tok"))
    template = Template("auto", loaded)
    assert template.name == "tokenizer"
    for got, want in zip(template.encode(MULTI), Template("tokenizer", chat_tok).encode(MULTI)):
        np.testing.assert_array_equal(got, want)


def test_template_that_rewrites_the_answer_is_refused_naming_the_row():
    from swift_mcore.data.conversations import Conversation

    template = Template("auto", with_chat_template(COUNTING_TEMPLATE))
    assert template.name == "tokenizer"
    with pytest.raises(ArgumentError) as err:
        template.encode(Conversation(SINGLE, where="--dataset chat.jsonl, row 7"))
    assert str(err.value) == (
        "--dataset chat.jsonl, row 7: the chat template of test-chat-tokenizer renders "
        "assistant message 1 without the generation prompt before it (it rewrites earlier "
        "text when the answer is added), so the answer tokens cannot be located; use "
        "--template chatml or plain")


def test_template_that_hides_earlier_answers_trains_one_sample_per_turn():
    """Each answer is trained after the history the template renders at inference for it:
    the earlier answer as '(earlier answer)', not as the text trained in the first sample."""
    template = Template("auto", with_chat_template(HIDING_TEMPLATE))
    samples = template.encode_samples(MULTI[1:])
    assert len(samples) == 2
    for (ids, turns), want in zip(samples, [
            [("User: Hi there\nAssistant: ", CONTEXT), ("Hello!", 0), ("\n", 0)],
            [("User: Hi there\nAssistant: (earlier answer)\nUser: Name a color.\n"
              "Assistant: ", CONTEXT), ("Blue.", 1), ("\n", 1)]]):
        # no end marker to end the answer: its newline is the template's answer text
        want_ids, want_turns = expected(template.tokenizer, want)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(turns, want_turns)


# ---- built-in templates exported as Hugging Face chat templates ---------------------------

@pytest.mark.parametrize("name", ["plain", "chatml"])
@pytest.mark.parametrize("system", [None, "You are terse."])
def test_builtin_template_as_jinja_renders_what_training_saw(name, system):
    from swift_mcore.data import default_tokenizer
    from swift_mcore.data.templates import attach_chat_template

    tokenizer = default_tokenizer()
    assert attach_chat_template(tokenizer, {"template": name, "system": system}) == name
    builtin, jinja = Template(name, tokenizer, system=system), Template("auto", tokenizer)
    assert jinja.name == "tokenizer"
    for messages in (SINGLE, MULTI, MULTI[1:]):
        want_ids, want_turns = builtin.encode(messages)
        ids, turns = jinja.encode(messages)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(turns, want_turns)
        assert tokenizer.hf.apply_chat_template(messages, tokenize=False) == tokenizer.decode(ids)
        assert jinja.prompt(messages[:-1]) == builtin.prompt(messages[:-1])
    assert jinja.end_marker() == builtin.end_marker()
    # A tokenizer with its own template keeps it.
    assert attach_chat_template(tokenizer, {"template": "chatml"}) is None
