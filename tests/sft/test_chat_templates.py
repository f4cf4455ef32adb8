"""Real-world chat templates (Qwen2.5 tools, Qwen3 reasoning, Llama-3; tests/sft/chat_templates.py):
for every assistant turn, the ids are apply_chat_template's (with tools=) and the prompt before
the answer is the one the model gets at inference; the trained tokens are exactly the
answer's text, tool calls and reasoning plus the end-of-turn marker; rows a template cannot
render are refused, naming the row."""

import json

import numpy as np
import pytest

from chat_templates import llama3, qwen25, qwen3
from swift_mcore.data.conversations import Conversation, to_conversation
from swift_mcore.data.templates import CONTEXT, Template
from swift_mcore.errors import ArgumentError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


AGENT = [  # two tool calls in one turn, two results, an answer, then a follow-up with both
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and time in Oslo?"},
    {"role": "assistant", "content": "",
     "tool_calls": [call("get_weather", city="Paris"), call("get_time", zone="Europe/Oslo")]},
    {"role": "tool", "content": "sunny, 21 C"},
    {"role": "tool", "content": "14:05"},
    {"role": "assistant", "content": "Paris is sunny (21 C); in Oslo it is 14:05."},
    {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "content": "Let me check.",
     "tool_calls": [call("get_weather", city="Rome")]},
    {"role": "tool", "content": "rain, 17 C"},
    {"role": "assistant", "content": "It rains in Rome (17 C)."}]
AGENT_ANSWERS = [  # what each assistant turn generates, as the Qwen2.5 template spells it
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}\n</tool_call>'
    '<|im_end|>',
    "Paris is sunny (21 C); in Oslo it is 14:05.<|im_end|>",
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
    '</tool_call><|im_end|>',
    "It rains in Rome (17 C).<|im_end|>"]

THINKING = [  # a Qwen3 conversation: reasoning in every turn, a tool call in the second
    {"role": "user", "content": "What is 3*4?"},
    {"role": "assistant", "content": "12.", "reasoning_content": "3 times 4 is 12."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should ask the tool.",
     "tool_calls": [call("get_weather", city="Paris")]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "The tool says sunny."}]
THINKING_ANSWERS = [
    "<think>\n3 times 4 is 12.\n</think>\n\n12.<|im_end|>",
    '<think>\nI should ask the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    "<think>\nThe tool says sunny.\n</think>\n\nSunny.<|im_end|>"]


@pytest.fixture(scope="module")
def qwen25_tok():
    return qwen25()


@pytest.fixture(scope="module")
def qwen3_tok():
    return qwen3()


def hf_ids(tokenizer, messages, tools=None, prompt=False):
    return tokenizer.hf.apply_chat_template(messages, tools=tools, tokenize=True,
                                            return_dict=False, add_generation_prompt=prompt)


def assert_turns_match_inference(tokenizer, samples, messages, tools, answers,
                                 prompt_ids=True):
    """Per assistant turn k (message i): its sample holds apply_chat_template(messages[:i+1])
    as a prefix, the tokens before its answer are the generation prompt of messages[:i]
    (its text, when not ``prompt_ids``), and its trained tokens are one run that decodes to
    exactly answers[k]."""
    turn = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        [(ids, turns)] = [s for s in samples if (s[1] == turn).any()]
        at = np.flatnonzero(turns == turn)
        assert (np.diff(at) == 1).all(), f"turn {turn} is not one run"
        assert tokenizer.decode(ids[at]) == answers[turn]
        full = hf_ids(tokenizer, messages[:i + 1], tools)
        assert ids[:len(full)].tolist() == full, f"turn {turn}"
        prompt = hf_ids(tokenizer, messages[:i], tools, prompt=True)
        if prompt_ids:
            assert ids[:at[0]].tolist() == prompt
        assert tokenizer.decode(ids[:at[0]]) == tokenizer.decode(prompt)
        turn += 1
    assert turn == len(answers)
    trained = sum(int((turns != CONTEXT).sum()) for _, turns in samples)
    assert trained == sum(len(tokenizer.encode(a)) for a in answers)  # nothing else trained


# ---- Qwen2.5: tools --------------------------------------------------------------------

def test_qwen25_tool_calls_are_trained_and_tool_results_are_not(qwen25_tok):
    template = Template("auto", qwen25_tok)
    conversation = Conversation(AGENT, tools=[WEATHER, CLOCK], where="row 0")
    samples = template.encode_samples(conversation)
    assert len(samples) == 1  # Qwen2.5 renders a growing prefix: one sample, four answers
    assert_turns_match_inference(qwen25_tok, samples, AGENT, [WEATHER, CLOCK], AGENT_ANSWERS)
    ids, turns = samples[0]
    text = qwen25_tok.decode(ids)
    assert text == qwen25_tok.hf.apply_chat_template(AGENT, tools=[WEATHER, CLOCK],
                                                     tokenize=False)
    assert '"name": "get_time"' in qwen25_tok.decode(ids[turns == CONTEXT][:200])  # the tools
    context = qwen25_tok.decode(ids[turns == CONTEXT])
    for result in ("sunny, 21 C", "14:05\n</tool_response>", "rain, 17 C"):
        assert result in context


def test_openai_style_row_with_json_text_renders_the_same(qwen25_tok):
    """A row as OpenAI-style data stores it (tools and arguments as JSON text, content null)
    renders as the parsed objects do: chat templates expect objects (they apply tojson)."""
    messages = json.loads(json.dumps(AGENT))
    for m in messages:
        m.pop("content") if m.get("tool_calls") and not m["content"] else None
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
    row = {"messages": messages, "tools": json.dumps([WEATHER, CLOCK])}
    conversation = to_conversation(row, "--dataset agent.jsonl, row 0")
    template = Template("tokenizer", qwen25_tok)
    got = template.encode_samples(conversation)
    want = template.encode_samples(Conversation(AGENT, tools=[WEATHER, CLOCK]))
    for (ids, turns), (want_ids, want_turns) in zip(got, want):
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(turns, want_turns)


def test_train_separator_trains_the_newline_after_the_end_marker(qwen25_tok):
    conversation = Conversation(AGENT, tools=[WEATHER, CLOCK])
    [(ids, turns)] = Template("tokenizer", qwen25_tok, train_separator=True).encode_samples(
        conversation)
    for turn, answer in enumerate(AGENT_ANSWERS):
        assert qwen25_tok.decode(ids[turns == turn]) == answer + "\n"
    [(plain_ids, _)] = Template("tokenizer", qwen25_tok).encode_samples(conversation)
    np.testing.assert_array_equal(ids, plain_ids)  # the same ids, one more label per turn


# ---- Qwen3: reasoning dropped from earlier turns ----------------------------------------

def test_qwen3_multi_turn_trains_each_answer_after_its_inference_prompt(qwen3_tok):
    template = Template("auto", qwen3_tok)
    samples = template.encode_samples(Conversation(THINKING, where="row 3"))
    # Qwen3 drops turn 0's reasoning once a user speaks again: turn 1 starts a new sample
    # from that history; turn 2 follows a tool result, which keeps turn 1's reasoning.
    assert [sorted(set(t[t != CONTEXT].tolist())) for _, t in samples] == [[0], [1, 2]]
    assert_turns_match_inference(qwen3_tok, samples, THINKING, None, THINKING_ANSWERS)
    history = qwen3_tok.decode(samples[1][0])
    assert "<|im_start|>assistant\n12.<|im_end|>" in history and "3 times 4" not in history


def test_qwen3_last_turn_and_the_encoding_report(qwen3_tok):
    from swift_mcore.data.sft_datasets import EncodingReport, encode_conversations

    template = Template("tokenizer", qwen3_tok)
    rows = [Conversation(THINKING), Conversation(THINKING[:2])]
    report = EncodingReport()
    encoded = encode_conversations(rows, template, 512, "drop", "all_turns", report)
    assert (report.conversations, report.samples, report.split) == (2, 3, 1)
    assert report.describe("drop", 512) == (
        "3 of 3 samples kept from 2 conversations (1 split into one sample per assistant "
        "turn whose history the template re-renders)")
    assert len(encoded) == 3
    last = encode_conversations(rows, template, 512, "drop", "last_turn")
    assert len(last) == 2  # the sample holding each conversation's last answer
    ids, targets = last.sample(0)
    assert qwen3_tok.decode(ids[targets]) == THINKING_ANSWERS[2]


def test_generation_markers_decide_the_answers_as_in_transformers_masks():
    """A Qwen3 template with {% generation %} blocks: each sample's labels are transformers'
    assistant mask of that rendering, less the history's blocks (trained in their own
    samples); here the blocks hold what the renderings' differences hold."""
    marked_tok = qwen3(marked=True)
    template = Template("auto", marked_tok)
    assert template.marked and "{% generation %}" in template.describe()
    samples = template.encode_samples(Conversation(THINKING))
    assert_turns_match_inference(marked_tok, samples, THINKING, None, THINKING_ANSWERS)
    for (ids, turns), upto in zip(samples, (2, 6)):
        out = marked_tok.hf.apply_chat_template(THINKING[:upto], tokenize=True,
                                                return_dict=True,
                                                return_assistant_tokens_mask=True)
        assert ids.tolist() == out["input_ids"]
        mask = np.asarray(out["assistant_masks"], bool)
        first = np.flatnonzero(turns != CONTEXT)[0]
        mask[:first] = False  # the history's (stripped) answer is not this sample's
        np.testing.assert_array_equal(turns != CONTEXT, mask)
    unmarked = Template("tokenizer", qwen3()).encode_samples(Conversation(THINKING))
    for (ids, turns), (want_ids, want_turns) in zip(samples, unmarked):
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(turns, want_turns)


# ---- Llama-3 ----------------------------------------------------------------------------

def test_llama3_multi_turn_ids_and_labels():
    tok = llama3()
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"},
                {"role": "assistant", "content": "Rome."}]
    samples = Template("auto", tok).encode_samples(messages)
    assert len(samples) == 1
    # The test's GPT-2 style pre-tokenizer splits the cue's "\n\n" before a word into two
    # tokens (Llama-3's own keeps them one): the prompt before an answer is compared as text.
    assert_turns_match_inference(tok, samples, messages, None,
                                 ["Paris.<|eot_id|>", "Rome.<|eot_id|>"], prompt_ids=False)
    ids = samples[0][0]
    bos = tok.hf.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids[0] == bos and (ids == bos).sum() == 1


# ---- rows a template cannot render ------------------------------------------------------

RAISING = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
           "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


@pytest.mark.parametrize("case", ["chatml-tools", "llama3-tools", "llama3-tool-calls",
                                  "qwen25-reasoning", "raising-template"])
def test_rows_a_template_cannot_render_are_refused_naming_the_row(case):
    from chat_templates import QWEN_SPECIAL, chat_tokenizer

    where = "--dataset agent.jsonl, row 5"
    calls = AGENT[:4] + [{"role": "assistant", "content": "Sunny."}]
    tokenizer, template, conversation, message = {
        "chatml-tools": (qwen25(), "chatml", Conversation(AGENT, [WEATHER], where),
                         f"{where}: the conversation has a 'tools' list, which the built-in "
                         f"template 'chatml' does not render; use --template tokenizer"),
        "llama3-tools": (llama3(), "auto", Conversation(AGENT[1:2] + AGENT[5:6], [WEATHER],
                                                        where),
                         f"{where}: the conversation has a 'tools' list, which the chat "
                         f"template of llama3-style does not render (it would be dropped "
                         f"from training); give --tokenizer one whose template renders it"),
        "llama3-tool-calls": (llama3(), "auto", Conversation(calls[1:], None, where),
                              f"{where}: the conversation has tool_calls (message 1), which "
                              f"the chat template of llama3-style does not render"),
        "qwen25-reasoning": (qwen25(), "auto", Conversation(THINKING, None, where),
                             f"{where}: the conversation has reasoning_content (message 1), "
                             f"which the chat template of qwen2.5-style does not render"),
        "raising-template": (chat_tokenizer("strict", RAISING, QWEN_SPECIAL), "tokenizer",
                             Conversation(calls[1:], None, where),
                             f"{where}: the conversation has tool_calls (message 1), which "
                             f"the chat template of strict does not render"),
    }[case]
    with pytest.raises(ArgumentError) as err:
        Template(template, tokenizer).encode_samples(conversation)
    assert str(err.value).startswith(message), str(err.value)


def test_a_template_error_names_the_row():
    from chat_templates import QWEN_SPECIAL, chat_tokenizer

    strict = chat_tokenizer("strict", RAISING.replace("'tool'", "'assistant' and loop.index0 "
                                                      "> 1"), QWEN_SPECIAL)
    rows = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(ArgumentError) as err:
        Template("tokenizer", strict).encode_samples(Conversation(rows, None, "row 9"))
    assert str(err.value) == ("row 9: the chat template of strict cannot render this "
                              "conversation (TemplateError: Conversation roles must "
                              "alternate user/assistant)")


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": None, "tool_calls": "{not json"}]},
     "message 1's tool_calls is text but not valid JSON"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
     "message 1's tool call 0 must be an object with a 'function' holding 'name' and "
     "'arguments'"),
    ({"messages": [{"role": "user", "content": "q", "tool_calls": [call("f")]},
                   {"role": "assistant", "content": "a"}]},
     "message 0 (user) has tool_calls; only assistant messages call tools"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "tools": {"name": "f"}}, "'tools' must be a list (or its JSON text), got dict"),
])
def test_bad_tool_rows_are_named(row, message):
    with pytest.raises(ArgumentError) as err:
        to_conversation(row, "--dataset f.jsonl, row 0")
    assert str(err.value).startswith("--dataset f.jsonl, row 0: ")
    assert message in str(err.value)


def test_turn_split_benchmark_runs():
    import os
    import sys

    from run_helpers import ROOT

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import sft_turn_split

    [case] = sft_turn_split.main(["--rows", "2", "--turns", "2"])["cases"]
    assert case["samples"] == 4 and case["token_ratio"] > 1 and case["trained_tokens"] > 0


def test_tool_rows_read_from_jsonl_keep_each_rows_own_keys(tmp_path, qwen25_tok):
    """Rows whose tool calls have different argument names read back as written (no row
    gets another row's keys as nulls), and encode as the in-memory conversation does."""
    from swift_mcore.data.conversations import read_conversations
    from swift_mcore.data.sources import expand_inputs

    path = tmp_path / "agent.jsonl"
    plain = {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}]}
    path.write_text("\n".join(json.dumps(r) for r in (
        {"messages": AGENT, "tools": [WEATHER, CLOCK]}, plain)) + "\n")
    first, second = read_conversations(expand_inputs([str(path)], "--dataset"), {})
    assert first.messages == AGENT and first.tools == [WEATHER, CLOCK]
    assert second.tools is None and first.where == f"--dataset {path}, row 0"
    template = Template("tokenizer", qwen25_tok)
    [(ids, _)] = template.encode_samples(first)
    [(want, _)] = template.encode_samples(Conversation(AGENT, tools=[WEATHER, CLOCK]))
    np.testing.assert_array_equal(ids, want)
