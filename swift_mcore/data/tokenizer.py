"""Tokenizers: the built-in byte-level BPE trained on the embedded corpus, or a Hugging Face one."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable, List, Optional, Sequence

from megatron.core.tokenizers import MegatronTokenizerBase

from ..errors import ArgumentError
from ..input_files import check_regular, load_json
from . import corpus
from ..atomic_write import write_atomic
from ..cache import cache_dir, locked

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
DEFAULT_VOCAB_SIZE = 4096
# Part of the cache key: change it whenever the training recipe below changes.
_RECIPE = {"kind": "byte-level-bpe", "version": 1, "vocab_size": DEFAULT_VOCAB_SIZE,
           "special_tokens": [EOD_TOKEN, PAD_TOKEN]}
# Names a bare tokenizer.json commonly uses for the end of a document and for padding.
_EOD_NAMES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
_PAD_NAMES = (PAD_TOKEN, "<pad>", "[PAD]", "<|finetune_right_pad_id|>")
# Files a Hugging Face folder keeps its tokenizer in; a folder with none holds weights only.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "spiece.model", "vocab.json", "vocab.txt", "tekken.json")


class Tokenizer(MegatronTokenizerBase):
    """What megatron's GPT datasets need (vocab_size, eod, pad, unique_identifiers) and what
    our code needs (encode/decode, the HF tokenizer for export), over one fast backend.

    ``pad`` follows megatron's convention: -1 when the tokenizer has no pad token distinct from
    the EOD, so megatron never mistakes document separators for padding.
    """

    def __init__(self, source: str, backend=None, hf=None, eod: Optional[int] = None,
                 pad: Optional[int] = None):
        super().__init__(source, {})
        if backend is None and hf is None:
            raise ValueError("a Tokenizer needs a tokenizers backend or a HF tokenizer")
        self.source = source
        self.backend = backend if backend is not None else getattr(hf, "backend_tokenizer", None)
        if self.backend is not None:
            # A document is tokenized whole; a saved max_length or padding must not cut or pad it.
            self.backend.no_truncation()
            self.backend.no_padding()
        self._hf = hf
        self.eod = eod
        self.pad = pad if pad is not None and pad != eod else -1
        self.fingerprint = self._fingerprint()
        # megatron serializes the tokenizer into its dataset cache key through this attribute;
        # the content fingerprint (not the path) makes the cache follow the vocabulary.
        self.unique_identifiers = {"class": "swift_mcore.Tokenizer",
                                   "fingerprint": self.fingerprint,
                                   "vocab_size": self.vocab_size, "eod": self.eod}

    # ---- megatron's interface ---------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return len(self._hf)
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict:
        if self._hf is not None:
            return self._hf.get_vocab()
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> List[int]:
        return self.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.decode(ids)

    def apply_chat_template(self, *args, **kwargs):
        return self.hf.apply_chat_template(*args, **kwargs)

    # ---- ours -------------------------------------------------------------------------
    @property
    def chat_template(self):
        """The Hugging Face chat template (Jinja text), or None; a bare tokenizer.json has
        none."""
        return getattr(self._hf, "chat_template", None)

    @property
    def hf(self):
        """The Hugging Face tokenizer (built on first use: importing transformers costs ~2 s)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            pad = self.backend.id_to_token(self.pad) if self.pad >= 0 else None
            self._hf = PreTrainedTokenizerFast(
                tokenizer_object=self.backend, eos_token=self.backend.id_to_token(self.eod),
                pad_token=pad)
        return self._hf

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` without BOS/EOS: documents are separated by ``eod`` only."""
        if self.backend is not None:
            return self.backend.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        if self.backend is not None:  # Rust, parallel across cores
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        return self._hf(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=False)
        return self._hf.decode(ids)

    def save_pretrained(self, folder: str) -> Any:
        return self.hf.save_pretrained(folder)

    def _fingerprint(self) -> str:
        """sha256 of what decides the ids of ``encode``: model, normalizer, pre-tokenizer and
        added tokens. Post-processor, decoder and padding settings are left out, so the same
        vocabulary saved through transformers (which adds a no-op post-processor) matches."""
        if self.backend is not None:
            spec = json.loads(self.backend.to_str())
            content = json.dumps(
                {"model": spec.get("model"), "normalizer": spec.get("normalizer"),
                 "pre_tokenizer": spec.get("pre_tokenizer"),
                 "added": [(t["id"], t["content"], t.get("special")) for t in
                           spec.get("added_tokens") or []]}, sort_keys=True)
        else:
            content = json.dumps(sorted(self._hf.get_vocab().items()))
        return hashlib.sha256(f"{content}\0eod={self.eod}".encode()).hexdigest()

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, eod={self.eod}, "
                f"pad={self.pad})")


# ---- building ---------------------------------------------------------------------------

def build_tokenizer(config) -> Tokenizer:
    """--tokenizer wins, then the tokenizer of --model, then the built-in default."""
    trust = config.data.trust_remote_code
    if config.data.tokenizer:
        return load_tokenizer(config.data.tokenizer, flag="--tokenizer", trust_remote_code=trust)
    if config.model.model:
        return load_tokenizer(config.model.model, flag="--model", trust_remote_code=trust)
    return default_tokenizer()


def default_tokenizer() -> Tokenizer:
    """The byte-level BPE of the embedded corpus, trained once per corpus and cached."""
    from tokenizers import Tokenizer as Backend

    key = hashlib.sha256(
        (corpus.fingerprint() + json.dumps(_RECIPE, sort_keys=True)).encode()).hexdigest()[:20]
    folder = cache_dir("tokenizers", key)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        with locked(folder):
            if not os.path.isfile(path):  # another process may have built it while we waited
                write_atomic(path, train_bpe(corpus.iter_documents()).to_str())
    backend = Backend.from_file(path)
    return Tokenizer(path, backend=backend, eod=backend.token_to_id(EOD_TOKEN),
                     pad=backend.token_to_id(PAD_TOKEN))


def train_bpe(documents: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A GPT-2 style byte-level BPE; every byte is in the alphabet, so nothing is ever unknown."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOD_TOKEN, PAD_TOKEN], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(documents, trainer)
    return backend


def custom_code(folder: str) -> List[str]:
    """The Python classes a Hugging Face folder asks transformers to import from its own
    files (``auto_map`` of tokenizer_config.json and config.json)."""
    found: List[str] = []
    for name in ("tokenizer_config.json", "config.json"):
        try:
            auto_map = load_json(os.path.join(folder, name)).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(auto_map, dict):
            continue
        for value in auto_map.values():
            for ref in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(ref, str) and ref not in found:
                    found.append(ref)
    return found


def _remote_code_refusal(flag: str, path: str) -> ArgumentError:
    classes = custom_code(path)
    what = f" ({', '.join(classes[:3])})" if classes else ""
    return ArgumentError(f"{flag} {path}: the tokenizer needs Python code that ships with the "
                         f"folder{what}; swift-mcore runs it only with --trust_remote_code "
                         f"(read that code first)")


def has_tokenizer_files(folder: str) -> bool:
    """Whether a folder holds a tokenizer (any of TOKENIZER_FILES, or a .tiktoken file)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(n in TOKENIZER_FILES or n.endswith(".tiktoken") for n in names)


# Files of a tokenizer folder transformers may open, besides TOKENIZER_FILES.
_READ_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")


def _check_files_regular(path: str, flag: str) -> None:
    """A FIFO or device among the files transformers opens would block it or never end."""
    if not os.path.isdir(path):
        check_regular(path, f"{flag} {path}")
        return
    for name in sorted(os.listdir(path)):
        if name in TOKENIZER_FILES or name.endswith(_READ_SUFFIXES):
            full = os.path.join(path, name)
            if not os.path.isdir(full):
                check_regular(full, f"{flag} {full}")


def load_tokenizer(path: str, flag: str = "--tokenizer",
                   trust_remote_code: bool = False) -> Tokenizer:
    """A Hugging Face tokenizer folder (or model folder), or a single tokenizer.json file.
    Code shipped in the folder runs only with ``trust_remote_code``; transformers is told
    so explicitly, so it never asks on stdin."""
    if not os.path.exists(path):
        raise ArgumentError(f"{flag} {path} does not exist (expected a Hugging Face tokenizer "
                            f"folder or a tokenizer.json file)")
    if os.path.isdir(path) and not has_tokenizer_files(path):
        raise ArgumentError(
            f"{flag} {path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])} ...): "
            f"a folder of weights only; give the tokenizer with --tokenizer PATH (a Hugging "
            f"Face tokenizer folder or a tokenizer.json file)")
    _check_files_regular(path, flag)
    try:
        if os.path.isfile(path):
            from tokenizers import Tokenizer as Backend

            backend = Backend.from_file(path)
            vocab = backend.get_vocab(with_added_tokens=True)
            eod = next((vocab[n] for n in _EOD_NAMES if n in vocab), None)
            pad = next((vocab[n] for n in _PAD_NAMES if n in vocab), None)
            tokenizer = Tokenizer(path, backend=backend, eod=eod, pad=pad)
        else:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                               trust_remote_code=bool(trust_remote_code))
            eod = hf.eos_token_id
            if eod is None:
                vocab = hf.get_vocab()
                eod = next((vocab[n] for n in _EOD_NAMES if n in vocab), None)
            tokenizer = Tokenizer(path, hf=hf, eod=eod, pad=hf.pad_token_id)
    except Exception as err:  # HF raises many types (OSError, ValueError, JSON errors...)
        if "trust_remote_code" in str(err) and not trust_remote_code:
            raise _remote_code_refusal(flag, path) from None
        text = (str(err).strip().splitlines() or [""])[0][:300]
        raise ArgumentError(f"{flag} {path} could not be loaded as a Hugging Face tokenizer: "
                            f"{type(err).__name__}: {text}") from None
    if tokenizer.eod is None:
        raise ArgumentError(
            f"{flag} {path}: the tokenizer has no end-of-document token (no eos_token and none "
            f"of {', '.join(_EOD_NAMES)}); pretraining needs one to separate documents")
    return tokenizer
