"""Preference pairs (prompt, chosen, rejected): rows read, tokenized as TRL 1.16's
DPOTrainer tokenizes them, and batched chosen-first.

Formats (docs/rlhf.md): TRL's standard one (``prompt``/``chosen``/``rejected`` text), its
conversational one (message lists, with an optional ``tools`` column), its implicit-prompt
one (``chosen``/``rejected`` only: the prompt is their common start), and ms-swift's
(``messages`` whose last assistant turn is the chosen answer, plus ``rejected_response``).
Text answers get the EOS appended; the completion starts where the tokenized prompt and
the tokenized prompt + answer diverge (TRL's rule). KTO's unpaired rows (data/unpaired.py)
are read, tokenized, laid out and fingerprinted with the same functions.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import ArgumentError
from .conversations import _refuse_media
from .sequence_rows import lay_out, packing_note

# Part of the fingerprint: change it whenever tokenizing changes what a pair becomes.
ENCODING_VERSION = 1


@dataclass
class Pair:
    """One row in TRL's explicit-prompt form: text, or message lists (conversational)."""

    prompt: Any
    chosen: Any
    rejected: Any
    tools: Optional[List[Dict[str, Any]]]
    where: str
    margin: Optional[float] = None  # a reward model's per-row margin (TRL's 'margin' column)

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


def _is_messages(value) -> bool:
    return (isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict)
            and "role" in value[0])


def _messages(value, where: str, what: str) -> List[Dict[str, Any]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not _is_messages(value):
        raise ArgumentError(f"{where}: '{what}' must be a list of messages "
                            f"({{'role': ..., 'content': ...}}), got {value!r:.80}")
    return [{k: v for k, v in m.items() if v is not None} for m in value]


def _implicit_prompt(chosen, rejected) -> Tuple[Any, Any, Any]:
    """TRL's extract_prompt: the common start of chosen and rejected is the prompt (for text,
    a space before the first difference goes with the answers)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def to_pair(row: Dict[str, Any], where: str) -> Pair:
    """One row -> a Pair; raises ArgumentError naming the row and what is accepted."""
    _refuse_media(row, where)  # the rlhf tasks train text: images would be dropped unsaid
    if row.get("chosen") is None and row.get("messages") is None and \
            row.get("completion") is not None and row.get("label") is not None:
        raise ArgumentError(f"{where}: an unpaired row (prompt/completion/label, TRL's KTO "
                            f"format); this task trains on pairs: prompt/chosen/rejected, or "
                            f"messages + rejected_response")
    pair = _row_pair(row, where)
    pair.margin = _margin(row.get("margin"), where)
    return pair


def _margin(value, where: str) -> Optional[float]:
    """A row's 'margin': a finite number (or absent/null)."""
    import math
    import numbers

    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or \
            not math.isfinite(float(value)):
        raise ArgumentError(f"{where}: 'margin' must be a finite number, got {value!r:.80}")
    return float(value)


def row_tools(row: Dict[str, Any], where: str) -> Optional[List[Dict[str, Any]]]:
    """A row's 'tools': a list of tool schemas (JSON objects), or its JSON text, or none;
    anything else is refused (the chat template raised on it)."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise ArgumentError(f"{where}: 'tools' is not valid JSON") from None
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise ArgumentError(f"{where}: 'tools' must be a list of tool schemas (JSON objects), "
                            f"got {tools!r:.80}")
    return tools


@contextmanager
def rendering(where: str):
    """A chat template that raises on a row (roles out of order, ...) names the row."""
    from jinja2.exceptions import TemplateError

    try:
        yield
    except TemplateError as err:
        text = (str(err).strip().splitlines() or [""])[0][:200]
        raise ArgumentError(f"{where}: the tokenizer's chat template cannot render it: "
                            f"{text}") from None


def _row_pair(row: Dict[str, Any], where: str) -> Pair:
    tools = row_tools(row, where)
    # TRL's columns win over a 'messages' column beside them (ultrafeedback_binarized's
    # 'messages' is its prompt + chosen conversation, as TRL ignores it)
    trl_form = row.get("chosen") is not None and row.get("rejected") is not None
    if trl_form and row.get("rejected_response") is not None:
        raise ArgumentError(f"{where}: both TRL's 'chosen'/'rejected' and ms-swift's "
                            f"'rejected_response' (with 'messages'); keep one form")
    if row.get("messages") is not None and not trl_form:  # ms-swift: the last turn is chosen
        messages = _messages(row["messages"], where, "messages")
        rejected = row.get("rejected_response")
        if rejected is None:
            raise ArgumentError(f"{where}: a 'messages' row needs 'rejected_response', the "
                                f"rejected answer to its last assistant turn")
        if messages[-1].get("role") != "assistant":
            raise ArgumentError(f"{where}: the last message must be the assistant's (the "
                                f"chosen answer), got role {messages[-1].get('role')!r}")
        if not isinstance(rejected, str):
            raise ArgumentError(f"{where}: 'rejected_response' must be text")
        return Pair(messages[:-1], [messages[-1]],
                    [{"role": "assistant", "content": rejected}], tools, where)
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if chosen is None or rejected is None:
        present = ", ".join(repr(k) for k, v in row.items() if v is not None) or "none"
        missing = "rejected" if chosen is not None else "chosen"
        raise ArgumentError(
            f"{where}: no '{missing}' answer (the row has {present}); a preference row has "
            f"prompt/chosen/rejected, or messages + rejected_response")
    prompt = row.get("prompt")
    if is_conversational(chosen):
        chosen = _messages(chosen, where, "chosen")
        rejected = _messages(rejected, where, "rejected")
        # TRL's maybe_extract_prompt: a text 'prompt' beside conversations that hold it
        # (ultrafeedback_binarized's) is ignored, the prompt taken from their common start
        text_prompt = isinstance(prompt, str) and not _is_messages(_try_json(prompt))
        if prompt is None or text_prompt:
            prompt, chosen, rejected = _implicit_prompt(chosen, rejected)
        else:
            prompt = _messages(prompt, where, "prompt")
        return Pair(prompt, chosen, rejected, tools, where)
    for name, value in (("chosen", chosen), ("rejected", rejected), ("prompt", prompt)):
        if _is_messages(value):
            raise ArgumentError(f"{where}: '{name}' is a list of messages but 'chosen' is "
                                f"text; a row's prompt and answers are all text or all "
                                f"message lists")
        if value is not None and not isinstance(value, str):
            raise ArgumentError(f"{where}: '{name}' must be text or a list of messages, got "
                                f"{type(value).__name__}")
    if prompt is None:
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected)
    return Pair(prompt, chosen, rejected, None, where)


def is_conversational(answer) -> bool:
    """Whether an answer is a list (of messages), or the JSON text of a list of messages."""
    return isinstance(answer, list) or (isinstance(answer, str) and answer.lstrip()[:1] == "["
                                        and _is_messages(_try_json(answer)))


def _try_json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def read_rows(sources, flag: str, to_items: Callable[[Dict[str, Any], str], list]) -> list:
    """What ``to_items(row, where)`` makes of every row of ``sources``, in order (``where``
    names the file and row); a file without rows is refused."""
    from .sources import read_batches

    items: list = []
    for source in sources:
        before = len(items)
        rows = (dict(zip(batch, values)) for batch in read_batches(source, flag, batch_size=256)
                for values in zip(*batch.values()))
        for index, row in enumerate(rows):
            items.extend(to_items(row, f"{flag} {source.path}, row {index}"))
        if len(items) == before:
            raise ArgumentError(f"{flag} {source.path}: is empty (no rows)")
    return items


def read_pairs(sources, flag: str = "--dataset") -> List[Pair]:
    return read_rows(sources, flag, lambda row, where: [to_pair(row, where)])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_with_prompt(row, answers: Sequence[Any], hf) -> Tuple[List[int], List[List[int]]]:
    """(prompt ids, [prompt + answer ids for each answer]) as TRL 1.16's DPOTrainer and
    KTOTrainer tokenize them: a conversation through the chat template (the prompt with the
    generation prompt), a text answer with the EOS appended; ``row`` is a Pair or an
    Unpaired (its prompt, tools, conversational), ``hf`` the Hugging Face tokenizer."""
    if row.conversational:
        def ids(messages, **kwargs):
            return list(hf.apply_chat_template(messages, tools=row.tools, tokenize=True,
                                               return_dict=True, **kwargs)["input_ids"])

        return (ids(row.prompt, add_generation_prompt=True),
                [ids(row.prompt + answer) for answer in answers])
    eos = hf.eos_token
    return (list(hf(text=row.prompt)["input_ids"]),
            [list(hf(text=row.prompt + (answer if answer.endswith(eos) else answer + eos))
                  ["input_ids"]) for answer in answers])


def check_chat_template(row, hf, prompt: bool = True) -> None:
    """A conversation row (a Pair or a KTO row) is rendered by the tokenizer's chat
    template: without one, or (``prompt``: the task renders the prompt alone) with no turn
    before the answer, refuse it naming the row instead of transformers' traceback."""
    if not row.conversational:
        return
    if prompt and not row.prompt:
        raise ArgumentError(f"{row.where}: no message before the answer; a conversation's "
                            f"prompt holds at least one turn (the user's) before the "
                            f"assistant's answer")
    if not getattr(hf, "chat_template", None):
        raise ArgumentError(
            f"{row.where}: its messages are rendered with the tokenizer's chat template, and "
            f"the tokenizer of {hf.name_or_path} has none; give the rows as text (prompt/"
            f"chosen/rejected strings; kto: prompt/completion) or a model whose "
            f"tokenizer_config.json has a chat_template (an sft run exported with "
            f"`swift-mcore export --to_hf` has one)")


def tokenize_pair(pair: Pair, hf) -> Tuple[List[int], List[int], List[int]]:
    """(prompt ids, chosen ids, rejected ids) as TRL 1.16's DPOTrainer makes them; ``hf`` is
    the Hugging Face tokenizer."""
    check_chat_template(pair, hf)
    prompt, (with_chosen, with_rejected) = tokenize_with_prompt(
        pair, (pair.chosen, pair.rejected), hf)
    start = min(_common_prefix(prompt, with_chosen), _common_prefix(prompt, with_rejected))
    return prompt[:start], with_chosen[start:], with_rejected[start:]


def tokenize_pair_per_answer(pair: Pair, hf) -> Tuple[List[int], List[int], List[int], int,
                                                       int]:
    """(shared prompt ids, chosen ids, rejected ids, how many of chosen's first ids are
    still its prompt, the same for rejected) as TRL 1.16's ORPOTrainer and CPOTrainer make
    them: the text (a conversation rendered by the chat template) tokenized without
    special tokens, each answer's prompt ending where the tokenized prompt ends, one token
    earlier if prompt + answer merged across that boundary; the BOS put first and the EOS
    appended as tokens where missing."""
    check_chat_template(pair, hf)
    if pair.conversational:
        def text(messages, **kwargs):
            return hf.apply_chat_template(messages, tools=pair.tools, tokenize=False, **kwargs)

        # TRL's apply_chat_template: the prompt rendered for generation (or continuing its
        # last assistant turn), cut to what it shares with each rendered prompt + answer
        ends_assistant = pair.prompt[-1].get("role") == "assistant"
        prompt = text(pair.prompt, add_generation_prompt=not ends_assistant,
                      continue_final_message=ends_assistant)
        full = [text(pair.prompt + a) for a in (pair.chosen, pair.rejected)]
        for other in full:
            prompt = prompt[:_common_prefix(prompt, other)]
        answers = [f[len(prompt):] for f in full]
    else:
        prompt, answers = pair.prompt, [pair.chosen, pair.rejected]
    prompt_ids = list(hf(prompt, add_special_tokens=False)["input_ids"])
    bos, eos = hf.bos_token_id, hf.eos_token_id
    split = []
    for answer in answers:
        full = list(hf(prompt + answer, add_special_tokens=False)["input_ids"])
        start = len(prompt_ids) - (prompt_ids != full[:len(prompt_ids)])
        head, tail = full[:start], full[start:]
        if bos is not None and (not head or head[0] != bos):
            head = [bos] + head
        if not tail or tail[-1] != eos:
            tail = tail + [eos]
        split.append((head, tail))
    (chosen_head, chosen), (rejected_head, rejected) = split
    shared = _common_prefix(chosen_head, rejected_head)
    return (chosen_head[:shared], chosen_head[shared:] + chosen,
            rejected_head[shared:] + rejected, len(chosen_head) - shared,
            len(rejected_head) - shared)


class TokenizedRows(torch.utils.data.Dataset):
    """Tokenized rows (``encoded``) and how ``collate`` lays them out: each sequence cut to
    ``max_length`` tokens as TRL's collators cut it, padded with ``pad_id`` to a multiple of
    ``pad_multiple``, or to ``pad_to`` (every row's width: pipeline stages exchange one fixed
    shape), or packed in rows of at most ``pack_to`` positions (--packing)."""

    def __init__(self, encoded: Sequence[tuple], max_length: int, truncation_mode: str,
                 pad_id: int, fingerprint: str, pad_multiple: int = 1,
                 pack_to: Optional[int] = None, pad_to: Optional[int] = None):
        self.encoded = encoded
        self.max_length = max_length
        self.truncation_mode = truncation_mode
        self.pad_id = pad_id
        self.fingerprint = fingerprint
        self.pad_multiple = pad_multiple
        self.pack_to = pack_to
        self.pad_to = pad_to

    def __len__(self) -> int:
        return len(self.encoded)

    def _cut(self, ids: np.ndarray) -> np.ndarray:
        if len(ids) <= self.max_length:
            return ids
        return ids[:self.max_length] if self.truncation_mode == "keep_start" \
            else ids[-self.max_length:]


class PreferenceDataset(TokenizedRows):
    """Tokenized pairs; ``collate`` makes a micro-batch of B pairs into 2B rows, the chosen
    sequences first, each cut to ``max_length`` tokens as TRL's collator cuts them.

    With ``pack_to`` (--packing) the 2B sequences are laid end to end in rows of at most
    ``pack_to`` positions (data/sequence_rows.py) instead of one padded row each:
    ``segment_ids`` then gives each position's sequence (chosen i is i, rejected i is B + i;
    padding -1), which keeps the sequences apart in attention and sums each one's
    log-probabilities. An item is still one pair, so the data order and resume are the
    unpacked run's."""

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        prompt, chosen, rejected, *heads = self.encoded[index]
        # heads: how many first ids of each answer are still its prompt (ORPO's, SimPO's)
        heads = heads[0] if heads else np.zeros(2, np.int32)
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "heads": heads,
                "index": index}

    def collate(self, items: List[Dict[str, np.ndarray]]) -> Dict[str, torch.Tensor]:
        seqs, masks = [], []
        for side, answer in enumerate(("chosen", "rejected")):
            for item in items:
                head = len(item["prompt"]) + int(item["heads"][side])
                seq = np.concatenate([item["prompt"], item[answer]])
                seqs.append(self._cut(seq))
                masks.append(self._cut(np.arange(len(seq)) >= head))
        batch, _ = lay_out(seqs, self.pad_id, masks, pack_to=self.pack_to,
                           pad_multiple=self.pad_multiple, pad_to=self.pad_to)
        # the answers' token counts as TRL's ipo and sigmoid_norm divide by them
        batch["completion_lengths"] = torch.tensor([int(m.sum()) for m in masks],
                                                   dtype=torch.float)
        batch["num_tokens"] = torch.tensor(sum(len(s) for s in seqs), dtype=torch.long)
        # which pairs these are (--precompute_ref_log_probs looks their reference values up)
        batch["pair_index"] = torch.tensor([int(item["index"]) for item in items],
                                           dtype=torch.long)
        return batch


@dataclass
class PairReport:
    pairs: int = 0
    truncated: int = 0
    prompt_fills: List[str] = None

    def describe(self, max_length: int) -> str:
        text = f"{self.pairs} preference pairs"
        if self.truncated:
            text += f"; {self.truncated} cut to --max_length {max_length}"
        return text


def _check_predicted(pair: Pair, prompt, answers, heads) -> None:
    """orpo and simpo average each answer's log-probability over the answer tokens the model
    predicts: a sequence's first token is predicted by nothing, so an answer that is only
    that token (an empty prompt, no BOS) has none, and its mean is 0/0 (TRL: nan; orpo's
    log odds of it: a nan gradient)."""
    for side, answer, head in zip(("chosen", "rejected"), answers, heads):
        if len(prompt) + head == 0 and len(answer) - head <= 1:
            raise ArgumentError(f"{pair.where}: the {side} answer has no token the model "
                                f"predicts (an empty prompt and no BOS: its one token starts "
                                f"the sequence), so the mean log-probability orpo and simpo "
                                f"train is undefined; give the row a prompt")


def encode_pairs(pairs: List[Pair], hf, max_length: int, truncation_mode: str,
                 report: PairReport, per_answer: bool = False):
    """The pairs tokenized as DPOTrainer does, or with ``per_answer`` as ORPOTrainer and
    CPOTrainer do (tokenize_pair_per_answer)."""
    encoded = []
    fills = []
    for pair in pairs:
        heads = ()
        if per_answer:
            with rendering(pair.where):
                prompt, chosen, rejected, *extra = tokenize_pair_per_answer(pair, hf)
            heads = (np.asarray(extra, np.int32),)
            _check_predicted(pair, prompt, (chosen, rejected), extra)
        else:
            with rendering(pair.where):
                prompt, chosen, rejected = tokenize_pair(pair, hf)
        # keep_start would cut every answer token of a prompt that fills --max_length:
        # TRL drops such rows silently; here they are counted and refused.
        longest_prompt = len(prompt) + (int(heads[0].max()) if heads else 0)
        if truncation_mode == "keep_start" and longest_prompt >= max_length:
            fills.append(pair.where)
            continue
        if len(prompt) + max(len(chosen), len(rejected)) > max_length:
            report.truncated += 1
        encoded.append((np.asarray(prompt, np.int32), np.asarray(chosen, np.int32),
                        np.asarray(rejected, np.int32), *heads))
    report.pairs = len(encoded)
    refuse_filled_prompts(fills, len(pairs), max_length)
    return encoded


def refuse_filled_prompts(fills: List[str], rows: int, max_length: int) -> None:
    """The refusal of the rows ``fills`` names (of ``rows``), whose prompt fills
    --max_length under keep_start; none, nothing."""
    if fills:
        raise ArgumentError(
            f"{len(fills)} of {rows} rows have a prompt of --max_length {max_length} "
            f"tokens or more, which would leave no answer token to train (first: "
            f"{fills[0]}); raise --max_length (and --seq_length), shorten those prompts, or "
            f"use --truncation_mode keep_end")


def sequence_pad_multiple(config) -> int:
    """What every row's width is a multiple of: --sequence_parallel splits each row's
    positions over the tensor-parallel ranks, --context_parallel_size N cuts each row into
    2N chunks (a padded position is masked out of the loss)."""
    p = config.parallel
    cp = p.context_parallel_size
    return (p.tensor_model_parallel_size if p.sequence_parallel else 1) * (2 * cp if cp > 1
                                                                           else 1)


def max_length_of(config) -> int:
    r = config.rlhf
    return r.max_length if r.max_length is not None else config.model.seq_length + 1


def build_preference_datasets(config, tokenizer, log: Callable[[str], None] = print,
                              on_cache: Callable[[str], None] = lambda event: None):
    """(train, None, None): the --dataset pairs; ``config`` is a RunConfig. The pairs are
    tokenized once into the rlhf cache (data/rlhf_cache.py) under the data's fingerprint;
    ``on_cache`` hears "built" or "reused"."""
    from .rlhf_cache import cached_rows

    r = config.rlhf
    max_length = max_length_of(config)
    per_answer = _per_answer(config)
    fingerprint = preference_fingerprint(config, tokenizer)

    def encode():
        made = PairReport()
        pairs = read_pairs(list(config.dataset_sources))
        rows = encode_pairs(pairs, tokenizer.hf, max_length, r.truncation_mode, made,
                            per_answer=per_answer)
        return rows, {"pairs": made.pairs, "truncated": made.truncated}

    encoded, meta = cached_rows("preference", fingerprint, ("prompt", "chosen", "rejected"),
                                {"heads": ("int32", 2)} if per_answer else {}, encode,
                                tokenizer.vocab_size, on_event=on_cache)
    report = PairReport(pairs=meta["pairs"], truncated=meta["truncated"])
    pad = tokenizer.hf.pad_token_id
    pad_id = pad if pad is not None else tokenizer.eod
    train = PreferenceDataset(encoded, max_length, r.truncation_mode, pad_id,
                              f"{fingerprint}:train",
                              pad_multiple=sequence_pad_multiple(config),
                              pack_to=config.model.seq_length if _packing(config) else None,
                              # packed rows under stages: the shapes are exchanged
                              pad_to=(config.model.seq_length
                                      if config.world.pipeline_parallel > 1
                                      and not _packing(config) else None))
    log(f"rlhf data --dataset: {report.describe(max_length)} "
        f"(truncation: {r.truncation_mode}){packing_note(train.pack_to)}")
    return train, None, None


def preference_fingerprint(config, tokenizer) -> str:
    """Identity of a run's preference data (rows_fingerprint)."""
    extra = {"tokenized_as": "ORPOTrainer/CPOTrainer"} if _per_answer(config) else {}
    return rows_fingerprint(config, tokenizer, ENCODING_VERSION, **extra)


def rows_fingerprint(config, tokenizer, version: int, **extra) -> str:
    """Identity of a run's rlhf rows, from the files alone: their content, the tokenizer
    and its chat template, the flags that change the rows, the encoding ``version`` and
    ``extra``."""
    from .sources import content_fingerprint

    r = config.rlhf
    identity = {
        "version": version,
        "train": content_fingerprint(config.dataset_sources),
        "tokenizer": tokenizer.fingerprint,
        "chat_template": tokenizer.chat_template,
        "max_length": max_length_of(config),
        "truncation_mode": r.truncation_mode,
        **extra,
    }
    if r.packing:  # other rows (a resume across the change is refused)
        identity["packing"] = True
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _per_answer(config) -> bool:
    """orpo and simpo tokenize as TRL's ORPOTrainer and CPOTrainer (each answer its own
    prompt boundary, BOS and EOS as tokens)."""
    from ..arguments.rlhf import REFERENCE_FREE_TYPES

    return config.rlhf.rlhf_type in REFERENCE_FREE_TYPES


def _packing(config) -> bool:
    return config.rlhf.packing
