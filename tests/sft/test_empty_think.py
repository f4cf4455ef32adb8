"""--ignore_empty_think: an answer's empty <think></think> block (Qwen3's template writes one
into answers without reasoning) is left out of the loss by default; real reasoning is not."""

import json

import numpy as np
import pytest

from chat_templates import qwen3
from swift_mcore.arguments import SftArguments
from swift_mcore.data.conversations import Conversation
from swift_mcore.data.sft_datasets import build_sft_datasets, sft_fingerprint
from swift_mcore.data.templates import CONTEXT, Template
from swift_mcore.run_config import resolve

NO_REASONING = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
REASONING = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."}]


@pytest.fixture(scope="module")
def qwen3_tok():
    return qwen3()


def trained_text(tokenizer, template, messages):
    [(ids, turns)] = template.encode_samples(Conversation(messages))
    return ids, tokenizer.decode(ids[turns != CONTEXT])


def test_empty_think_block_is_not_trained_unless_asked(qwen3_tok):
    kept = Template("tokenizer", qwen3_tok)
    ignored = Template("tokenizer", qwen3_tok, ignore_empty_think=True)
    ids, trained = trained_text(qwen3_tok, kept, NO_REASONING)
    assert trained == "<think>\n\n</think>\n\nHello.<|im_end|>"  # what the template renders
    same_ids, trained = trained_text(qwen3_tok, ignored, NO_REASONING)
    np.testing.assert_array_equal(ids, same_ids)  # the same text; only the labels differ
    assert trained == "Hello.<|im_end|>"
    # Real reasoning is trained either way.
    want = "<think>\nGreet back.\n</think>\n\nHello.<|im_end|>"
    assert trained_text(qwen3_tok, kept, REASONING)[1] == want
    assert trained_text(qwen3_tok, ignored, REASONING)[1] == want


def test_the_flag_defaults_to_leaving_empty_blocks_untrained(qwen3_tok, tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFT_MCORE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"messages": NO_REASONING}) + "\n", encoding="utf-8")

    def run(**flags):
        args = resolve(SftArguments.from_flags(dataset=[str(path)], seq_length=64,
                                               template="tokenizer", **flags),
                       world_size=1, cuda=False)
        events = []
        train, _, _ = build_sft_datasets(args, qwen3_tok, log=lambda s: None,
                                         on_cache=events.append)
        row = train[0]
        return (qwen3_tok.decode(row["labels"][row["loss_mask"]]), events,
                sft_fingerprint(args, qwen3_tok))

    default, events, fingerprint = run()
    assert default == "Hello.<|im_end|>" and events == ["built"]
    trained, events, other = run(ignore_empty_think=False)
    assert trained == "<think>\n\n</think>\n\nHello.<|im_end|>"
    assert events == ["built"] and other != fingerprint  # another cache entry, another run
