"""sft data: conversations read from every format, encoded with exact label targets,
truncated and counted, split, packed, batched; every bad input is an ArgumentError naming
the file, row or flag, and the CLI stops with it before touching --output_dir."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from swift_mcore.errors import ArgumentError
from swift_mcore.arguments import SftArguments
from swift_mcore.arguments.sft import column_map
from swift_mcore.data.conversations import read_conversations, to_messages
from swift_mcore.data.packing import block_causal_mask, pack
from swift_mcore.data.sft_datasets import (EncodingReport, SftDataset, _flat, build_sft_datasets,
                                  encode_conversations, split)
from swift_mcore.data.sources import expand_inputs
from swift_mcore.data.templates import CONTEXT, Template
from swift_mcore.run_config import resolve

ROOT = Path(__file__).resolve().parents[2]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


TWO_TURNS = [system("Be brief."), user("Hi"), assistant("Hello!"), user("Color?"),
             assistant("Blue.")]
CONVERSATIONS = [
    [user("What is 2+2?"), assistant("4")],
    [user("Capital of France?"), assistant("Paris is the capital of France.")],
    TWO_TURNS,
]


@pytest.fixture(scope="module")
def tok():
    from swift_mcore.data import default_tokenizer

    return default_tokenizer()


@pytest.fixture(scope="module")
def plain(tok):
    return Template("plain", tok)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def sft_args(**flags):
    flags.setdefault("seq_length", 64)
    flags.setdefault("template", "plain")
    return resolve(SftArguments.from_flags(**flags), world_size=1, cuda=False)


def targets_of(encoded):
    """The targets of the kept samples, back to back (the arrays also hold cut-off tokens)."""
    return np.concatenate([encoded.sample(k)[1] for k in range(len(encoded))])


def encoded_rows(encoded):
    return [encoded.sample(k)[0].tolist()
            for k in range(len(encoded))]


# ---- encoding: targets, loss_on, truncation -----------------------------------------------

def test_targets_all_turns_and_last_turn(plain):
    ids, turns = plain.encode(TWO_TURNS)
    report = EncodingReport()
    everything = encode_conversations([TWO_TURNS], plain, 256, "drop", "all_turns", report)
    last = encode_conversations([TWO_TURNS], plain, 256, "drop", "last_turn")
    for encoded in (everything, last):
        np.testing.assert_array_equal(encoded.ids, ids)
        assert encoded.starts.tolist() == [0] and encoded.ends.tolist() == [len(ids)]
        np.testing.assert_array_equal(encoded.positions(), [len(ids) - 1])
    first_answer = np.flatnonzero(turns == 0)
    second_answer = np.flatnonzero(turns == 1)
    want_all = np.zeros(len(ids), bool)
    want_all[first_answer] = want_all[second_answer] = True
    want_last = np.zeros(len(ids), bool)
    want_last[second_answer] = True
    np.testing.assert_array_equal(everything.targets, want_all)
    np.testing.assert_array_equal(last.targets, want_last)
    tokenizer = plain.tokenizer
    assert tokenizer.decode(ids[first_answer]) == "Hello!<|endoftext|>"
    assert tokenizer.decode(ids[second_answer]) == "Blue.<|endoftext|>"
    assert (report.conversations, report.truncated, report.dropped_long,
            report.dropped_empty) == (1, 0, 0, 0)


@pytest.fixture(scope="module")
def long_set(tok, plain):
    """Four conversations around a --seq_length of len(exact) - 1: short, a long answer, a
    long question (the answer lies past the cut on the right), and one exactly seq + 1 long."""
    short = [user("Hi"), assistant("Yo")]
    long_answer = [user("Count."), assistant(" ".join(str(i) for i in range(40)))]
    long_question = [user(" ".join(f"w{i}" for i in range(40))), assistant("Done.")]
    exact = [user("Tell me a fact."), assistant("Water is wet and the sky is blue.")]
    convs = [short, long_answer, long_question, exact]
    full = [plain.encode(c) for c in convs]
    seq = len(full[3][0]) - 1
    lengths = [len(ids) for ids, _ in full]
    assert lengths[0] < seq + 1 < lengths[1] and lengths[2] > seq + 1
    context_of_question = int(np.flatnonzero(full[2][1] != CONTEXT)[0])
    assert context_of_question > seq + 1  # the whole answer is beyond a right cut
    return convs, full, seq


def encode_long(plain, long_set, strategy):
    convs, _, seq = long_set
    report = EncodingReport()
    encoded = encode_conversations(convs, plain, seq, strategy, "all_turns", report)
    return encoded, report


def test_truncation_drop(plain, long_set):
    _, full, seq = long_set
    encoded, report = encode_long(plain, long_set, "drop")
    assert encoded_rows(encoded) == [full[0][0].tolist(), full[3][0].tolist()]
    np.testing.assert_array_equal(targets_of(encoded),
                                  np.concatenate([full[0][1] != CONTEXT, full[3][1] != CONTEXT]))
    assert (report.conversations, report.truncated, report.dropped_long,
            report.dropped_empty) == (4, 0, 2, 0)
    assert report.describe("drop", seq) == (
        f"2 of 4 conversations kept; 2 dropped as longer than --seq_length {seq} "
        f"(--truncation_strategy drop)")


def test_truncation_right_drops_a_conversation_whose_answer_is_cut_away(plain, long_set):
    _, full, seq = long_set
    encoded, report = encode_long(plain, long_set, "right")
    # The long question lost its whole answer: dropped, not trained on as prompt only.
    assert encoded_rows(encoded) == [full[0][0].tolist(), full[1][0][:seq + 1].tolist(),
                                     full[3][0].tolist()]
    np.testing.assert_array_equal(encoded.positions(), [len(full[0][0]) - 1, seq, seq])
    np.testing.assert_array_equal(
        encoded.sample(1)[1],
        full[1][1][:seq + 1] != CONTEXT)
    assert encoded.sample(1)[1][-1]  # the cut keeps answer tokens to the end
    assert (report.conversations, report.truncated, report.dropped_long,
            report.dropped_empty) == (4, 1, 0, 1)
    assert report.describe("right", seq) == (
        f"3 of 4 conversations kept; 1 cut on the right to --seq_length {seq}; 1 dropped "
        f"with no answer token left after the cut")


def test_truncation_left(plain, long_set):
    _, full, seq = long_set
    encoded, report = encode_long(plain, long_set, "left")
    assert encoded_rows(encoded) == [full[0][0].tolist(), full[1][0][-seq - 1:].tolist(),
                                     full[2][0][-seq - 1:].tolist(), full[3][0].tolist()]
    np.testing.assert_array_equal(
        targets_of(encoded),
        np.concatenate([full[0][1] != CONTEXT,
                                         full[1][1][-seq - 1:] != CONTEXT,
                                         full[2][1][-seq - 1:] != CONTEXT,
                                         full[3][1] != CONTEXT]))
    # The long answer cut on the left is all answer: every token is a target.
    assert encoded.sample(1)[1].all()
    assert (report.conversations, report.truncated, report.dropped_long,
            report.dropped_empty) == (4, 2, 0, 0)
    assert report.describe("left", seq) == (
        f"4 of 4 conversations kept; 2 cut on the left to --seq_length {seq}")


def test_cuts_at_the_edge_of_an_answer(plain):
    """A right cut that keeps the answer's first token trains on it; a left cut that keeps
    only the answer's last token (the EOD, as the row's first token, which is never a label)
    leaves nothing to learn: dropped, and counted as dropped only."""
    tokenizer = plain.tokenizer
    conv = [user("Question here"), assistant("A"), user("and a follow-up left unanswered")]
    ids, turns = plain.encode(conv)
    answer = np.flatnonzero(turns != CONTEXT).tolist()
    assert tokenizer.decode(ids[answer]) == "A<|endoftext|>" and len(answer) == 2
    start, eod_at = answer

    report = EncodingReport()
    kept = encode_conversations([conv], plain, start, "right", "all_turns", report)
    assert encoded_rows(kept) == [ids[:start + 1].tolist()]
    assert targets_of(kept).tolist() == [False] * start + [True]
    assert (report.truncated, report.dropped_empty) == (1, 0)

    report = EncodingReport()
    tail = len(ids) - eod_at  # tokens from the EOD to the end
    dropped = encode_conversations([conv], plain, tail - 1, "left", "all_turns", report)
    assert len(dropped) == 0
    assert (report.conversations, report.truncated, report.dropped_empty) == (1, 0, 1)
    kept = encode_conversations([conv], plain, tail, "left", "all_turns")
    assert encoded_rows(kept) == [ids[start:].tolist()]
    assert targets_of(kept).tolist() == [True, True] + [False] * (tail - 1)


# ---- SftDataset items and batches ---------------------------------------------------------

@pytest.fixture(scope="module")
def encoded(plain):
    return encode_conversations(CONVERSATIONS, plain, 64, "drop", "all_turns")


def dataset(encoded, rows, packed=False, pad_to_seq_length=False, seq=64, pad_id=1):
    return SftDataset(encoded, rows, seq, pad_id, packed, pad_to_seq_length, "test")


def test_item_is_shifted_with_the_answer_mask(plain, encoded):
    ds = dataset(encoded, [[0], [1], [2]])
    assert len(ds) == 3
    for k, conv in enumerate(CONVERSATIONS):
        ids, turns = plain.encode(conv)
        item = ds[k]
        assert sorted(item) == ["labels", "loss_mask", "position_ids", "segment_ids", "tokens"]
        np.testing.assert_array_equal(item["tokens"], ids[:-1])
        np.testing.assert_array_equal(item["labels"], ids[1:])
        np.testing.assert_array_equal(item["loss_mask"], turns[1:] != CONTEXT)
        np.testing.assert_array_equal(item["position_ids"], np.arange(len(ids) - 1))
        np.testing.assert_array_equal(item["segment_ids"], np.zeros(len(ids) - 1))
    # Exact positions for the first: position i predicts ids[i + 1]; the answer "4" + EOD
    # are the last two tokens, so the last two positions are trained on, nothing else.
    ids, _ = plain.encode(CONVERSATIONS[0])
    n = len(ids) - 1
    assert np.flatnonzero(ds[0]["loss_mask"]).tolist() == [n - 2, n - 1]
    assert ds[0]["labels"][n - 2:].tolist() == plain.tokenizer.encode("4") + [
        plain.tokenizer.eod]


def test_packed_item_restarts_positions_and_never_crosses(plain, encoded):
    ds = dataset(encoded, [[0, 2, 1]], packed=True)
    item = ds[0]
    parts = [plain.encode(CONVERSATIONS[k]) for k in (0, 2, 1)]
    np.testing.assert_array_equal(item["tokens"], np.concatenate([i[:-1] for i, _ in parts]))
    np.testing.assert_array_equal(item["labels"], np.concatenate([i[1:] for i, _ in parts]))
    np.testing.assert_array_equal(item["loss_mask"],
                                  np.concatenate([t[1:] != CONTEXT for _, t in parts]))
    np.testing.assert_array_equal(
        item["position_ids"], np.concatenate([np.arange(len(i) - 1) for i, _ in parts]))
    np.testing.assert_array_equal(
        item["segment_ids"], np.concatenate([np.full(len(i) - 1, s)
                                             for s, (i, _) in enumerate(parts)]))
    # Each conversation's last label is its own EOD, never the next one's first token.
    ends = np.cumsum([len(i) - 1 for i, _ in parts]) - 1
    assert item["labels"][ends].tolist() == [plain.tokenizer.eod] * 3
    assert item["position_ids"][ends[:-1] + 1].tolist() == [0, 0]


def test_collate_pads_to_the_longest_and_masks_padding(encoded):
    ds = dataset(encoded, [[0], [1]], pad_id=7)
    a, b = ds[0], ds[1]
    na, nb = len(a["tokens"]), len(b["tokens"])
    assert na < nb
    batch = ds.collate([a, b])
    assert sorted(batch) == ["labels", "loss_mask", "num_tokens", "padding_mask", "position_ids",
                             "tokens"]
    assert batch["tokens"].shape == (2, nb) and batch["tokens"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.float
    assert batch["tokens"][0].tolist() == a["tokens"].tolist() + [7] * (nb - na)
    assert batch["labels"][0].tolist() == a["labels"].tolist() + [7] * (nb - na)
    assert batch["loss_mask"][0].tolist() == a["loss_mask"].astype(float).tolist() + [0.0] * (
        nb - na)
    assert batch["position_ids"][0].tolist() == list(range(na)) + [0] * (nb - na)
    assert batch["tokens"][1].tolist() == b["tokens"].tolist()
    assert batch["loss_mask"][1].tolist() == b["loss_mask"].astype(float).tolist()
    assert batch["num_tokens"].item() == na + nb
    assert batch["padding_mask"].tolist() == [[False] * na + [True] * (nb - na), [False] * nb]
    assert batch["loss_mask"].sum().item() == a["loss_mask"].sum() + b["loss_mask"].sum()


def test_collate_packed_rows_pad_as_their_own_segment(encoded):
    ds = dataset(encoded, [[0, 1], [2]], packed=True, seq=64)
    rows = [ds[0], ds[1]]
    lengths = [len(r["tokens"]) for r in rows]
    batch = ds.collate(rows)
    width = max(lengths)
    assert batch["segment_ids"].shape == (2, width)
    for i, (row, n) in enumerate(zip(rows, lengths)):
        assert batch["segment_ids"][i].tolist() == row["segment_ids"].tolist() + [-1] * (
            width - n)
        assert batch["position_ids"][i, :n].tolist() == row["position_ids"].tolist()
        assert not batch["loss_mask"][i, n:].any()
    assert batch["num_tokens"].item() == sum(lengths)


def test_collate_pad_to_seq_length(encoded):
    ds = dataset(encoded, [[0], [2]], pad_to_seq_length=True, seq=64, pad_id=1)
    rows = [ds[0], ds[1]]
    batch = ds.collate(rows)
    assert batch["tokens"].shape == (2, 64)
    for i, row in enumerate(rows):
        n = len(row["tokens"])
        assert batch["tokens"][i, :n].tolist() == row["tokens"].tolist()
        assert batch["tokens"][i, n:].eq(1).all() and not batch["loss_mask"][i, n:].any()
    assert batch["num_tokens"].item() == sum(len(r["tokens"]) for r in rows) < 2 * 64


# ---- packing ------------------------------------------------------------------------------

def test_pack_best_fit_decreasing_by_hand():
    # Longest first: 8 opens row 0 (room 2), 6 opens row 1 (room 4), 3 joins row 1 (room 1);
    # 1 then fits both rows and best fit puts it in the fuller row 1, where first fit would
    # have taken row 0.
    assert pack([1, 6, 8, 3], 10) == [[2], [0, 1, 3]]
    # Exact fits are found: three full rows.
    assert pack([7, 3, 6, 4, 5, 5], 10) == [[0, 1], [2, 3], [4, 5]]
    # Ties in length go by index; rows list their items in index order.
    assert pack([4, 4, 4], 8) == [[0, 1], [2]]
    assert pack([], 8) == []


def test_pack_is_deterministic_and_places_every_item_once():
    lengths = np.random.default_rng(3).integers(1, 65, size=300)
    rows = pack(lengths, 64)
    assert rows == pack(list(lengths), 64) == pack(lengths.tolist(), 64)
    assert sorted(k for row in rows for k in row) == list(range(300))
    assert all(sum(lengths[k] for k in row) <= 64 for row in rows)
    assert all(row == sorted(row) for row in rows)
    # No two rows could be merged: each row was opened by an item that fit no earlier row.
    loads = sorted(int(sum(lengths[k] for k in row)) for row in rows)
    assert loads[0] + loads[1] > 64
    # Pinned: the rows are part of what a resumed run must find again (volume bound: 151).
    assert -(-int(lengths.sum()) // 64) == 151 and len(rows) == 155


def test_pack_refuses_an_item_longer_than_a_row():
    with pytest.raises(ValueError, match="item 1 has 9 positions, more than a row's 8"):
        pack([3, 9], 8)


def test_block_causal_mask_by_hand():
    segments = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 0, 0, 0, 0, 0]])
    mask = block_causal_mask(segments)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    o, x = False, True  # o: attends, x: masked
    expected_packed = [
        [o, x, x, x, x, x],
        [o, o, x, x, x, x],
        [x, x, o, x, x, x],
        [x, x, o, o, x, x],
        [x, x, o, o, o, x],
        [x, x, x, x, x, o],  # padding sees only itself
    ]
    expected_single = [[j > i for j in range(6)] for i in range(6)]
    assert mask[0, 0].tolist() == expected_packed
    assert mask[1, 0].tolist() == expected_single


# ---- split --------------------------------------------------------------------------------

def numbered(n):
    """n conversations whose ids say which they are: conversation k is [k] * (k + 2)."""
    return _flat([(np.full(k + 2, k, np.int32), np.ones(k + 2, bool)) for k in range(n)])


def which(encoded):
    return [row[0] for row in encoded_rows(encoded)]


def test_split_is_a_fixed_disjoint_draw():
    data = numbered(20)
    train, valid = split(data, 0.25, seed=7)
    assert len(valid) == 5 and len(train) == 15
    assert sorted(which(train) + which(valid)) == list(range(20))
    assert which(train) == sorted(which(train)) and which(valid) == sorted(which(valid))
    for k, row in zip(which(valid), encoded_rows(valid)):
        assert row == [k] * (k + 2)  # conversations are taken whole
    again_train, again_valid = split(numbered(20), 0.25, seed=7)
    assert which(again_valid) == which(valid) and which(again_train) == which(train)
    draws = {tuple(which(split(data, 0.25, seed=s)[1])) for s in range(6)}
    assert len(draws) > 1  # the seed decides the draw


def test_split_sizes_round_and_keep_one_each_side():
    data = numbered(10)
    assert [len(part) for part in split(data, 0.01, 0)] == [9, 1]  # at least one held out
    assert [len(part) for part in split(data, 0.34, 0)] == [7, 3]
    with pytest.raises(ArgumentError, match=r"--split_dataset_ratio 0.96 leaves no training "
                                            r"conversation of 10"):
        split(data, 0.96, 0)


# ---- conversation rows ----------------------------------------------------------------------

def test_query_response_system_history_to_messages():
    row = {"system": "Be brief.", "history": [["Hi", "Hello!"], ["Color?", "Blue."]],
           "query": "Shape?", "response": "Round."}
    assert to_messages(row, "here") == [
        system("Be brief."), user("Hi"), assistant("Hello!"), user("Color?"), assistant("Blue."),
        user("Shape?"), assistant("Round.")]
    assert to_messages({"query": "Q", "response": "A", "system": None, "history": None},
                       "here") == [user("Q"), assistant("A")]
    messages = [user("Q"), assistant("A")]
    assert to_messages({"messages": messages, "query": None}, "here") == messages


@pytest.mark.parametrize("row, message", [
    ({"instruction": "Q", "output": "A"},
     "f.jsonl, row 0: no 'messages' column and no 'query'/'response' columns (it has "
     "'instruction', 'output'); rename yours with --columns, e.g. --columns "
     "instruction=query output=response"),
    ({"messages": [user("Q")]},
     "f.jsonl, row 0: the conversation has no assistant turn, so there is nothing to learn "
     "from it"),
    ({"messages": [system("S")]}, "the conversation has no assistant turn"),
    ({"messages": [user("Q"), {"role": "function", "content": "x"}, assistant("A")]},
     "f.jsonl, row 0: message 1 has role 'function'; accepted roles: system, user, "
     "assistant, tool"),
    ({"messages": [user("Q"), assistant("A"), system("S"), user("Q2"), assistant("A2")]},
     "f.jsonl, row 0: message 2 is a system message; only the first message may be one"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [user("Q"), {"role": "assistant"}]}, "message 1 must be an object with "
                                                        "'role' and 'content'"),
    ({"messages": [user("Q"), assistant(3)]}, "message 1's content must be text, got int"),
    ({"query": "Q"}, "f.jsonl, row 0: has 'query' but no 'response' column value"),
    ({"query": "Q", "response": "A", "history": [["only one"]]},
     "history entry 0 must be a [query, response] pair"),
])
def test_bad_rows_are_named(row, message):
    with pytest.raises(ArgumentError) as err:
        to_messages(row, "--dataset f.jsonl, row 0")
    assert message in str(err.value)


def test_read_conversations_names_file_and_row(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [user("Q"), assistant("A")]},
        {"messages": [user("Q"), assistant("A")]},
        {"messages": [user("Q"), user("Still me")]}])
    with pytest.raises(ArgumentError) as err:
        read_conversations(expand_inputs([path], "--val_dataset"), {}, "--val_dataset")
    assert str(err.value) == (f"--val_dataset {path}, row 2: the conversation has no "
                              f"assistant turn, so there is nothing to learn from it")

    path = write_jsonl(tmp_path / "instr.jsonl", [{"instruction": "Q", "output": "A"}])
    with pytest.raises(ArgumentError) as err:
        read_conversations(expand_inputs([path]), {})
    assert str(err.value).startswith(f"--dataset {path}, row 0: no 'messages' column")
    assert "(it has 'instruction', 'output')" in str(err.value)
    assert "--columns" in str(err.value)


def test_multimodal_rows_are_refused_naming_row_and_column(tmp_path):
    """An images/videos/audios column would be dropped by a text-only model without a word."""
    path = write_jsonl(tmp_path / "mm.jsonl", [
        {"messages": [user("Q"), assistant("A")], "images": []},
        {"messages": [user("<image>What is shown?"), assistant("A cat.")],
         "images": ["cat.png"]}])
    with pytest.raises(ArgumentError) as err:
        read_conversations(expand_inputs([path]), {})
    assert str(err.value) == (
        f"--dataset {path}, row 1: column 'images' holds images (the text refers to them "
        f"with <image>); a text model trained on the text alone would drop them: give "
        f"--model a vision-language model (Qwen2.5-VL, Qwen3-VL: docs/multimodal.md), or "
        f"remove the column to train on the text")
    path = write_jsonl(tmp_path / "audio.jsonl", [
        {"query": "Transcribe", "response": "hello", "speech": ["a.wav"]}])
    with pytest.raises(ArgumentError, match=r"row 0: column 'audios' holds audios; .*audios are "
                                                r"not supported, or remove the column"):
        read_conversations(expand_inputs([path]), {"speech": "audios"})


def test_tools_given_as_json_text_nested_100000_deep_are_refused():
    row = {"messages": [user("Q"), assistant("A")], "tools": "[" * 100_000 + "]" * 100_000}
    with pytest.raises(ArgumentError, match=r"^f.jsonl, row 0: 'tools': JSON nested 100000 "):
        read_rows_of([row])


def read_rows_of(rows):
    from swift_mcore.data.conversations import to_conversation

    return [to_conversation(row, f"f.jsonl, row {i}") for i, row in enumerate(rows)]


def test_columns_naming_a_column_the_data_lacks_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "instr.jsonl", [{"query": "Q", "response": "A"}])
    with pytest.raises(ArgumentError) as err:
        read_conversations(expand_inputs([path]), {"instruction": "query"})
    assert str(err.value) == (f"--dataset {path}: --columns renames 'instruction', a column "
                              f"the data does not have (its columns: 'query', 'response')")


def test_sft_cli_refuses_a_multimodal_dataset_before_writing(tmp_path):
    path = write_jsonl(tmp_path / "mm.jsonl", [
        {"messages": [user("<image>What?"), assistant("A cat.")], "images": ["cat.png"]}])
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "sft", "--dataset", str(path),
                           "--num_layers", "1", "--hidden_size", "32", "--num_attention_heads",
                           "2", "--num_query_groups", "1", "--seq_length", "32",
                           "--train_iters", "1", "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"swift-mcore sft: error: --dataset {path}, row 0: column 'images' holds images")
    assert not (out / "checkpoint").exists()


# ---- arguments ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_args")
    return write_jsonl(folder / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])


@pytest.mark.parametrize("flags, message", [
    (dict(template="nope"), "--template must be one of auto, tokenizer, chatml, plain; "
                            "got 'nope'"),
    (dict(loss_on="first_turn"), "--loss_on must be one of all_turns, last_turn"),
    (dict(truncation_strategy="middle"), "--truncation_strategy must be one of drop, left, "
                                         "right"),
    (dict(columns=["instruction"]), "--columns: 'instruction' is not of the form from=to "
                                    "(e.g. --columns instruction=query output=response)"),
    (dict(columns=["instruction=prompt"]), "--columns: 'instruction' is mapped to 'prompt'; "
                                           "map columns to one of messages, tools, query, "
                                           "response, system, history"),
    (dict(columns=['{"instruction": "query"']), "--columns: not a valid JSON object"),
    (dict(columns=['{"instruction": "bogus"}']), "--columns: 'instruction' is mapped to "
                                                 "'bogus'"),
    (dict(data_path=["corpus_text_document"]), "--data_path holds pretraining .bin/.idx "
                                               "files; sft reads conversations from --dataset"),
    (dict(dataset=None), "sft needs --dataset"),
    (dict(val_dataset=["VAL"], split_dataset_ratio=0.1),
     "--val_dataset and --split_dataset_ratio are alternatives; give one of them"),
    (dict(split_dataset_ratio=1.0), "--split_dataset_ratio must be in [0, 1), got 1.0"),
    (dict(train_iters=10, num_train_epochs=2), "--train_iters and --num_train_epochs are "
                                               "alternatives; give one of them"),
    (dict(dataset=["/nonexistent/chat.jsonl"]), "--dataset /nonexistent/chat.jsonl: no such "
                                                "file or folder"),
    (dict(val_dataset=["/nonexistent/val.jsonl"]), "--val_dataset /nonexistent/val.jsonl: no "
                                                   "such file or folder"),
])
def test_bad_flags_are_refused_by_validate(chat_file, flags, message):
    flags = {"dataset": [chat_file], **flags}
    flags = {k: ([chat_file] if v == ["VAL"] else v) for k, v in flags.items()}
    with pytest.raises(ArgumentError) as err:
        resolve(SftArguments.from_flags(**flags), world_size=1, cuda=False)
    assert message in str(err.value)


def test_epochs_default_yields_to_train_iters(chat_file):
    assert sft_args(dataset=[chat_file]).training.num_train_epochs == 1.0
    assert sft_args(dataset=[chat_file], train_iters=5).training.num_train_epochs is None


def test_column_map_forms():
    assert column_map(None) == {}
    assert column_map(["instruction=query", "output=response"]) == {
        "instruction": "query", "output": "response"}
    assert column_map(["instruction=query output=response"]) == {
        "instruction": "query", "output": "response"}
    assert column_map(['{"instruction": "query",', '"output": "response"}']) == {
        "instruction": "query", "output": "response"}
    with pytest.raises(ArgumentError, match=r"--columns: '\[1\]' is not of the form from=to"):
        column_map(["[1]"])
    with pytest.raises(ArgumentError, match=r"--columns: 'output=' is not of the form"):
        column_map(["instruction=query", "output="])


def test_template_tokenizer_without_one_is_refused_when_building(chat_file, tok):
    args = sft_args(dataset=[chat_file], template="tokenizer")
    with pytest.raises(ArgumentError, match=r"--template tokenizer: the tokenizer \(.*\) has "
                                            r"no chat template; choose a built-in one: "
                                            r"--template chatml or plain"):
        build_sft_datasets(args, tok, log=lambda line: None)


# ---- files of every format through build_sft_datasets ---------------------------------------

def expected_rows(plain, conversations):
    return [plain.encode(c)[0].tolist() for c in conversations]


def test_every_format_reads_the_same_conversations(tmp_path, tok, plain):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    convs = CONVERSATIONS
    write_jsonl(tmp_path / "a.jsonl", [{"messages": c, "id": i} for i, c in enumerate(convs)])
    (tmp_path / "b.json").write_text(json.dumps([{"messages": c} for c in convs]),
                                     encoding="utf-8")
    # The same three as query/response pairs, the last with a system and a history.
    pq.write_table(pa.table({
        "query": ["What is 2+2?", "Capital of France?", "Color?"],
        "response": ["4", "Paris is the capital of France.", "Blue."],
        "system": [None, None, "Be brief."],
        "history": [[], None, [["Hi", "Hello!"]]]}), str(tmp_path / "c.parquet"))
    datasets.Dataset.from_list([{"messages": c} for c in convs]).save_to_disk(
        str(tmp_path / "saved"))
    want = expected_rows(plain, convs)
    for name in ("a.jsonl", "b.json", "c.parquet", "saved"):
        logs = []
        train, valid, test = build_sft_datasets(
            sft_args(dataset=[str(tmp_path / name)]), tok, log=logs.append)
        assert valid is None and test is None
        assert encoded_rows(train.encoded) == want, name
        assert len(train) == 3 and [train.conversations(r).tolist() for r in range(3)] == [
            [0], [1], [2]]
        assert logs == ["sft data --dataset: 3 of 3 conversations kept (template: built-in "
                        "'plain')"]
    # A folder of them reads them all, in path order.
    train, _, _ = build_sft_datasets(sft_args(dataset=[str(tmp_path)]), tok, log=lambda s: None)
    assert encoded_rows(train.encoded) == want * 4


@pytest.mark.parametrize("columns", [
    ["instruction=query", "output=response", "context=system"],
    ['{"instruction": "query", "output": "response", "context": "system"}'],
])
def test_columns_are_remapped(tmp_path, tok, plain, columns):
    path = write_jsonl(tmp_path / "instr.jsonl", [
        {"instruction": "What is 2+2?", "output": "4", "context": None},
        {"instruction": "Color?", "output": "Blue.", "context": "Be brief."}])
    train, _, _ = build_sft_datasets(sft_args(dataset=[path], columns=columns), tok,
                                     log=lambda s: None)
    assert encoded_rows(train.encoded) == expected_rows(plain, [
        [user("What is 2+2?"), assistant("4")],
        [system("Be brief."), user("Color?"), assistant("Blue.")]])


def test_validation_sets_packing_and_the_log(tmp_path, tok, plain):
    many = [[user(f"Question {i}?"), assistant(f"Answer {i}.")] for i in range(10)]
    train_path = write_jsonl(tmp_path / "train.jsonl", [{"messages": c} for c in many])
    val_path = write_jsonl(tmp_path / "val.jsonl", [{"messages": c} for c in many[:2]])

    train, valid, _ = build_sft_datasets(
        sft_args(dataset=[train_path], val_dataset=[val_path]), tok, log=lambda s: None)
    assert (len(train), len(valid)) == (10, 2)
    assert encoded_rows(valid.encoded) == expected_rows(plain, many[:2])

    args = sft_args(dataset=[train_path], split_dataset_ratio=0.2, seed=3)
    train, valid, _ = build_sft_datasets(args, tok, log=lambda s: None)
    held = encoded_rows(valid.encoded)
    assert (len(train), len(valid)) == (8, 2)
    assert sorted(encoded_rows(train.encoded) + held) == sorted(expected_rows(plain, many))
    again = build_sft_datasets(args, tok, log=lambda s: None)[1]
    assert encoded_rows(again.encoded) == held
    assert train.fingerprint.endswith(":train") and valid.fingerprint.endswith(":valid")

    logs = []
    train, _, _ = build_sft_datasets(sft_args(dataset=[train_path], packing=True, seq_length=64),
                                     tok, log=logs.append)
    lengths = train.encoded.positions()
    rows = [train.conversations(r).tolist() for r in range(len(train))]
    assert rows == pack(lengths, 64)
    assert sorted(k for row in rows for k in row) == list(range(10))
    assert len(train) < 10 and train.packed
    fill = lengths.sum() / (len(rows) * 64)
    assert logs[1] == (f"sft data train: 10 conversations packed into {len(rows)} rows of 64 "
                       f"positions ({fill:.1%} filled)")
    item = train[0]
    assert len(item["tokens"]) <= 64
    assert item["segment_ids"].max() == len(rows[0]) - 1


def test_nothing_left_to_train_on_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "long.jsonl", [
        {"messages": [user("a long question " * 20), assistant("ok")]}])
    with pytest.raises(ArgumentError, match=r"--dataset: no conversation is left to train on; "
                                            r"raise --seq_length"):
        build_sft_datasets(sft_args(dataset=[path], seq_length=16), tok, log=lambda s: None)


# ---- the command line -----------------------------------------------------------------------

def test_cli_bad_row_exits_2_before_touching_output_dir(tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [
        {"messages": [user("Q"), assistant("A")]},
        {"messages": [system("S"), user("Where is my answer?")]}])
    out = tmp_path / "out"
    out.mkdir()
    sentinel = out / "keep.txt"
    sentinel.write_text("precious")
    before = os.stat(sentinel).st_mtime_ns
    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "sft", "--dataset", data, "--output_dir",
         str(out), "--template", "plain", "--num_layers", "2", "--hidden_size", "64",
         "--num_attention_heads", "4", "--seq_length", "32", "--micro_batch_size", "1",
         "--global_batch_size", "1", "--num_workers", "0", "--tensorboard", "false",
         "--progress_bar", "false"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k not in ("NPROC_PER_NODE", "WORLD_SIZE")})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"swift-mcore sft: error: --dataset {data}, row 1: the conversation has no "
            f"assistant turn") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(os.listdir(out)) == ["keep.txt"]
    assert sentinel.read_text() == "precious" and os.stat(sentinel).st_mtime_ns == before
