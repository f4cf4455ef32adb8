"""Unpaired preference rows (prompt, completion, desirable or not) for KTO: read, tokenized
as TRL 1.16's KTOTrainer tokenizes them, and batched with the KL rows TRL pairs them with.

Formats (docs/rlhf.md): TRL's unpaired one (``prompt``/``completion``/``label``, text or
message lists, with an optional ``tools`` column), ms-swift's (``messages`` whose last
assistant turn is the completion, plus ``label``), and any preference-pair form
(data/preference.py), which becomes two rows, the chosen answer desirable and the
rejected one not (TRL's unpair_preference_dataset). Text completions get the EOS
appended; the completion starts where the tokenized prompt and prompt + completion diverge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import ArgumentError
from .conversations import _refuse_media
from .sequence_rows import lay_out, packing_note
from .preference import (PairReport, TokenizedRows, _common_prefix, _is_messages, _messages,
                         check_chat_template, is_conversational, max_length_of, read_rows,
                         refuse_filled_prompts, rendering, row_tools, rows_fingerprint,
                         sequence_pad_multiple, to_pair, tokenize_with_prompt)

# Part of the fingerprint: change it whenever tokenizing changes what a row becomes.
ENCODING_VERSION = 1


@dataclass
class Unpaired:
    """One row in TRL's unpaired form: text, or message lists (conversational)."""

    prompt: Any
    completion: Any
    desirable: bool
    tools: Optional[List[Dict[str, Any]]]
    where: str

    @property
    def conversational(self) -> bool:
        return isinstance(self.completion, list)


def _label(value, where: str) -> bool:
    # numpy's bool_ is what a parquet bool column may give; 0/1 or "true" are refused:
    # a label read wrong would silently train the opposite way
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ArgumentError(f"{where}: 'label' must be true (desirable) or false (undesirable), "
                        f"got {value!r:.40}")


def to_unpaired(row: Dict[str, Any], where: str) -> List[Unpaired]:
    """One row -> its unpaired rows (two for a preference pair); raises ArgumentError naming
    the row and what is accepted."""
    _refuse_media(row, where)  # KTO trains text: images would be dropped unsaid
    if row.get("label") is None:
        if any(row.get(k) is not None for k in ("chosen", "rejected", "rejected_response")):
            pair = to_pair(row, where)
            return [Unpaired(pair.prompt, pair.chosen, True, pair.tools, where),
                    Unpaired(pair.prompt, pair.rejected, False, pair.tools, where)]
        present = ", ".join(repr(k) for k, v in row.items() if v is not None) or "none"
        raise ArgumentError(f"{where}: no 'label' (the row has {present}); a KTO row has "
                            f"prompt/completion/label, or messages + label (label true for "
                            f"a desirable answer, false for an undesirable one)")
    desirable = _label(row["label"], where)
    tools = row_tools(row, where)
    # TRL's 'completion' wins over a 'messages' column beside it, as TRL ignores that
    if row.get("messages") is not None and row.get("completion") is None:  # ms-swift
        messages = _messages(row["messages"], where, "messages")
        if messages[-1].get("role") != "assistant":
            raise ArgumentError(f"{where}: the last message must be the assistant's (the "
                                f"labelled answer), got role {messages[-1].get('role')!r}")
        return [Unpaired(messages[:-1], [messages[-1]], desirable, tools, where)]
    prompt, completion = row.get("prompt"), row.get("completion")
    if completion is None or prompt is None:
        missing = "completion" if completion is None else "prompt"
        raise ArgumentError(f"{where}: no '{missing}'; a KTO row has prompt/completion/label, "
                            f"or messages + label")
    if is_conversational(completion):
        return [Unpaired(_messages(prompt, where, "prompt"),
                         _messages(completion, where, "completion"), desirable, tools, where)]
    if _is_messages(prompt):
        raise ArgumentError(f"{where}: 'prompt' is a list of messages but 'completion' is "
                            f"text; a row's prompt and completion are both text or both "
                            f"message lists")
    for name, value in (("completion", completion), ("prompt", prompt)):
        if not isinstance(value, str):
            raise ArgumentError(f"{where}: '{name}' must be text or a list of messages, got "
                                f"{type(value).__name__}")
    return [Unpaired(prompt, completion, desirable, None, where)]


def read_unpaired(sources, flag: str = "--dataset") -> List[Unpaired]:
    """Every row of ``sources``; KTO data with one class only is refused (its loss would
    have nothing to weigh the answers against)."""
    rows: List[Unpaired] = read_rows(sources, flag, to_unpaired)
    desirable = sum(r.desirable for r in rows)
    if desirable in (0, len(rows)):
        kind = "desirable (label true)" if desirable else "undesirable (label false)"
        files = " ".join(str(s.path) for s in sources)
        raise ArgumentError(f"{flag} {files}: all {len(rows)} rows are {kind}; --rlhf_type "
                            f"kto needs both desirable and undesirable answers")
    return rows


def tokenize_unpaired(row: Unpaired, hf) -> Tuple[List[int], List[int]]:
    """(prompt ids, completion ids) as TRL 1.16's KTOTrainer makes them; ``hf`` is the
    Hugging Face tokenizer."""
    check_chat_template(row, hf)
    prompt, (whole,) = tokenize_with_prompt(row, (row.completion,), hf)
    start = _common_prefix(prompt, whole)
    return prompt[:start], whole[start:]


@dataclass
class UnpairedReport(PairReport):
    desirable: int = 0

    def describe(self, max_length: int) -> str:
        text = (f"{self.pairs} KTO rows ({self.desirable} desirable, "
                f"{self.pairs - self.desirable} undesirable)")
        if self.truncated:
            text += f"; {self.truncated} cut to --max_length {max_length}"
        return text


def encode_unpaired(rows: List[Unpaired], hf, max_length: int, truncation_mode: str,
                    report: UnpairedReport):
    encoded, fills = [], []
    for row in rows:
        with rendering(row.where):
            prompt, completion = tokenize_unpaired(row, hf)
        # as for pairs: a prompt that fills --max_length under keep_start leaves no answer
        # token; TRL drops such rows silently, here they are counted and refused
        if truncation_mode == "keep_start" and len(prompt) >= max_length:
            fills.append(row.where)
            continue
        if len(prompt) + len(completion) > max_length:
            report.truncated += 1
        encoded.append((np.asarray(prompt, np.int32), np.asarray(completion, np.int32),
                        bool(row.desirable)))
    report.pairs = len(encoded)
    report.desirable = sum(e[2] for e in encoded)
    refuse_filled_prompts(fills, len(rows), max_length)
    return encoded


class UnpairedDataset(TokenizedRows):
    """Tokenized unpaired rows; ``collate`` makes a micro-batch of B rows plus B KL rows:
    row i's prompt with row i-1's completion (cyclically), TRL's mismatched pairs for the
    KL estimate, each cut to ``max_length`` tokens as the training rows are.

    With ``pack_to`` (--packing) the B rows, and apart from them the B KL rows, are laid end
    to end in rows of at most ``pack_to`` positions (data/sequence_rows.py): ``segment_ids``
    and ``kl_segment_ids`` give each position's row (i for row i; padding -1). An item is
    still one row, so the data order and resume are the unpacked run's."""

    def __init__(self, encoded: Sequence[Tuple[np.ndarray, np.ndarray, bool]], max_length: int,
                 truncation_mode: str, pad_id: int, fingerprint: str, pad_multiple: int = 1,
                 kl_rows: bool = True, pack_to: Optional[int] = None,
                 pad_to: Optional[int] = None):
        """``kl_rows``: False for a loss without a KL term (no KL rows are made)."""
        super().__init__(encoded, max_length, truncation_mode, pad_id, fingerprint,
                         pad_multiple, pack_to, pad_to)
        self.kl_rows = kl_rows

    def __getitem__(self, index: int) -> Dict[str, Any]:
        prompt, completion, desirable = self.encoded[index]
        return {"prompt": prompt, "completion": completion, "desirable": desirable}

    def _rows(self, prompts, completions, prefix: str) -> Dict[str, torch.Tensor]:
        seqs = [self._cut(np.concatenate([p, c])) for p, c in zip(prompts, completions)]
        masks = [self._cut(np.concatenate([np.zeros(len(p), bool), np.ones(len(c), bool)]))
                 for p, c in zip(prompts, completions)]
        batch, _ = lay_out(seqs, self.pad_id, masks, pack_to=self.pack_to,
                           pad_multiple=self.pad_multiple, pad_to=self.pad_to)
        batch.pop("sequence_mask")
        out = {prefix + k: v for k, v in batch.items()}
        out[prefix + "num_tokens"] = torch.tensor(sum(len(s) for s in seqs), dtype=torch.long)
        return out

    def collate(self, items: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        prompts = [item["prompt"] for item in items]
        completions = [item["completion"] for item in items]
        batch = self._rows(prompts, completions, "")
        if self.kl_rows:
            batch.update(self._rows(prompts, completions[-1:] + completions[:-1], "kl_"))
        batch["desirable"] = torch.tensor([bool(item["desirable"]) for item in items])
        return batch


def weight_advice(report: UnpairedReport, desirable_weight: float,
                  undesirable_weight: float) -> Optional[str]:
    """TRL's advice (the KTO paper's Eq. 8) when the classes are unbalanced and neither
    weight is in the range that balances them; None otherwise."""
    d = max(report.desirable, 1)
    u = max(report.pairs - report.desirable, 1)
    if d == u:
        return None
    d_ratio, u_ratio = u * undesirable_weight / d, d * desirable_weight / u
    d_low, d_high = round(d_ratio, 2), round(d_ratio * 1.33, 2)
    u_low, u_high = round(u_ratio / 1.33, 2), round(u_ratio, 2)
    if d_low <= desirable_weight <= d_high or u_low <= undesirable_weight <= u_high:
        return None
    return (f"{d} desirable and {u} undesirable rows: the KTO paper recommends either "
            f"--desirable_weight in [{d_low}, {d_high}] or --undesirable_weight in "
            f"[{u_low}, {u_high}] (not both)")


def build_unpaired_datasets(config, tokenizer, log: Callable[[str], None] = print,
                            on_cache: Callable[[str], None] = lambda event: None):
    """(train, None, None): the --dataset rows for KTO; ``config`` is a RunConfig. The rows
    are tokenized once into the rlhf cache (data/rlhf_cache.py) under the data's
    fingerprint; ``on_cache`` hears "built" or "reused"."""
    from .rlhf_cache import cached_rows

    r = config.rlhf
    max_length = max_length_of(config)
    fingerprint = unpaired_fingerprint(config, tokenizer)

    def encode():
        made = UnpairedReport()
        rows = read_unpaired(list(config.dataset_sources))
        encoded = encode_unpaired(rows, tokenizer.hf, max_length, r.truncation_mode, made)
        return encoded, {"pairs": made.pairs, "truncated": made.truncated}

    encoded, meta = cached_rows("kto", fingerprint, ("prompt", "completion"),
                                {"desirable": ("bool", 1)}, encode, tokenizer.vocab_size,
                                on_event=on_cache)
    report = UnpairedReport(pairs=meta["pairs"], truncated=meta["truncated"],
                            desirable=int(np.count_nonzero(encoded.values("desirable"))))
    pad = tokenizer.hf.pad_token_id
    pad_id = pad if pad is not None else tokenizer.eod
    train = UnpairedDataset(encoded, max_length, r.truncation_mode, pad_id,
                            f"{fingerprint}:train",
                            sequence_pad_multiple(config),
                            kl_rows=r.kto_loss_type() == "kto",
                            pack_to=config.model.seq_length if r.packing else None,
                            pad_to=(config.model.seq_length
                                    if config.world.pipeline_parallel > 1 else None))
    log(f"rlhf data --dataset: {report.describe(max_length)} "
        f"(truncation: {r.truncation_mode}){packing_note(train.pack_to)}")
    advice = weight_advice(report, r.desirable_weight, r.undesirable_weight)
    if advice:
        log(f"rlhf kto: {advice}")
    return train, None, None


def unpaired_fingerprint(config, tokenizer) -> str:
    """Identity of a run's KTO data (preference.rows_fingerprint)."""
    return rows_fingerprint(config, tokenizer, ENCODING_VERSION, task="kto")
