"""Train/valid/test GPT datasets (megatron.core.datasets): one epoch each, whatever train_iters.

Every split is built with ``num_samples=None`` (exactly one epoch); epochs and the order of
samples are the sampler's business (sampler.py), so changing --train_iters never changes the
data, and a resumed run maps the same global position to the same sample. ``--data_order
megatron`` instead builds them as Megatron-LM does, for ``megatron_num_samples`` samples
(GPTDataset then shuffles over all the epochs those need), through the builder as is.

A single prefix goes through ``BlendedMegatronDatasetBuilder.build()``. Blends of several
prefixes are assembled here from megatron's own pieces (the builder's per-prefix split
builder, ``GPTDataset``, ``BlendedDataset``) because in megatron-core 0.16.1 the builder:

* refuses weights without sizes ("Using client-specified weights requires client-specified
  size"), so a weighted blend needs a size that does not come from train_iters;
* loops forever in ``GPTDataset._get_num_epochs`` when a prefix has no document in a split
  but a size > 0 is asked of it (the default split 949,50,1 leaves small data without a test
  document);
* asserts in ``BlendedDataset`` (weights must be > 0) for an unweighted blend in which one
  prefix has an empty split.

Here a prefix with no complete sample in a split simply sits that split out. The size of a
weighted blend's split is the number of samples its prefixes hold in that split (one epoch of
the whole); the weights set the proportions, so a prefix weighted above its share of the data
is repeated and one weighted below it contributes the first part of its (shuffled) epoch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

from ..errors import ArgumentError

Blend = Tuple[List[str], Optional[List[float]]]


# ---- the blend --------------------------------------------------------------------------

def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(data_path: Sequence[str]) -> Blend:
    """Megatron's convention: ``[a, b]`` or ``[0.7, a, 0.3, b]`` -> (prefixes, weights or None)."""
    items = [str(x).strip() for x in data_path if str(x).strip()]
    shown = " ".join(items)
    if not items:
        raise ArgumentError("--data_path is empty; give dataset prefixes, optionally weighted "
                            "like '0.7 data/a 0.3 data/b'")
    numbers = [_number(x) for x in items]
    if len(items) % 2 == 0 and all(n is not None for n in numbers[0::2]) and \
            all(n is None for n in numbers[1::2]):
        weights = numbers[0::2]
        for w in weights:
            if not (math.isfinite(w) and w > 0):
                raise ArgumentError(f"--data_path weights must be positive numbers; got {w} in "
                                    f"'{shown}'")
        prefixes = items[1::2]
        return (prefixes, None) if len(prefixes) == 1 else (prefixes, weights)
    if all(n is None for n in numbers):
        return items, None
    raise ArgumentError(f"--data_path '{shown}' does not parse: give prefixes ('data/a data/b') "
                        f"or weight-prefix pairs ('0.7 data/a 0.3 data/b'), not a mix")


def _normalize_prefix(prefix: str) -> str:
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


def check_prefixes(prefixes: Sequence[str], flag: str = "--data_path") -> List[str]:
    """The prefixes without a .bin/.idx suffix, each pair checked whole (indexed.check_indexed)."""
    from .indexed import check_indexed

    out = []
    for prefix in prefixes:
        prefix = _normalize_prefix(prefix)
        check_indexed(prefix, flag)
        out.append(prefix)
    return out


def check_data_arguments(data) -> None:
    """What can be checked of the pretraining data flags before any process group exists:
    the blend parses, its .bin/.idx pairs are whole, --split parses. Called once, by
    run_config.resolve; the build checks the rest (file contents)."""
    if data.data_path:
        check_prefixes(parse_blend(data.data_path)[0])
    check_split(data.split)


def resolve_blend(config, tokenizer) -> Blend:
    """--data_path, else --dataset (tokenized once, cached), else the embedded corpus.
    ``config`` is a RunConfig (its data flags checked, --dataset expanded)."""
    from . import token_cache

    data = config.data
    if data.data_path:
        prefixes, weights = parse_blend(data.data_path)
        return [_normalize_prefix(p) for p in prefixes], weights
    if data.dataset:
        return [token_cache.raw_files_prefix(config.dataset_sources, data.text_key,
                                             tokenizer)], None
    return [token_cache.default_corpus_prefix(tokenizer)], None


def check_split(split: str) -> str:
    parts = [p.strip() for p in str(split).split(",")]
    values = [_number(p) for p in parts]
    if not 1 <= len(parts) <= 3 or any(v is None or v < 0 or not math.isfinite(v) for v in values) \
            or values[0] <= 0:
        raise ArgumentError(f"--split must be up to three non-negative numbers with a positive "
                            f"train part, like '949,50,1'; got {split!r}")
    return ",".join(parts)


# ---- megatron config and build ----------------------------------------------------------

def gpt_config(config, tokenizer, blend: Blend):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=config.training.seed,
        sequence_length=config.model.seq_length,
        blend=blend,
        split=check_split(config.data.split),
        path_to_cache=index_cache_path(config, blend[0]),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # The model side builds the causal mask once; a [1, s, s] mask per sample is waste.
        create_attention_mask=False,
    )


def index_cache_path(config, prefixes: Sequence[str]) -> str:
    """--data_cache_path (default output_dir/data_cache), then a folder per data content.

    megatron names its index files by a hash of the prefix *path*, split, seed, sequence
    length and tokenizer, not of the data: a prefix rewritten in place with other documents
    would reuse stale indices (samples cut at the old document boundaries, or indices past
    the new end). A folder keyed by the content of the .idx files rules that out.
    """
    base = config.data.data_cache_path or os.path.join(config.logging.output_dir, "data_cache")
    key = hashlib.sha256("\0".join(index_identity(p) for p in prefixes).encode())
    return os.path.join(base, key.hexdigest()[:16])


def build_datasets(config, tokenizer):
    """(train, valid, test) datasets; an empty split is None.

    Call on every rank after torch.distributed is initialized: rank 0 builds the index caches,
    the others wait at a barrier and load them (so the cache folder must be shared by all
    ranks, as megatron requires). By default every rank builds its datasets: our loaders are
    deterministic, so tensor- and pipeline-parallel peers read identical batches on their own
    instead of needing a broadcast. ``config`` is a RunConfig.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from . import safe_index_cache
    from .indexed import check_token_range

    safe_index_cache.activate()  # megatron's index caches: never unpickled, checked on load
    prefixes, weights = resolve_blend(config, tokenizer)
    for prefix in prefixes:
        check_token_range(prefix, tokenizer.vocab_size)
    dataset_config = gpt_config(config, tokenizer, (prefixes, weights))
    safe_index_cache.check_folder(dataset_config.path_to_cache)
    on_rank = lambda: True  # noqa: E731  (every rank: see above)
    epoch_samples = [samples_per_split(p, dataset_config) for p in prefixes]
    if sum(per_split[0] for per_split in epoch_samples) == 0:
        raise ArgumentError(
            f"the training split holds no complete sample: {_describe(prefixes)} has fewer than "
            f"--seq_length + 1 = {dataset_config.sequence_length + 1} tokens in the train part of "
            f"--split {config.data.split}; use more data or a shorter --seq_length")
    if config.data.data_order == "megatron":
        sizes = megatron_num_samples(config)
        if len(prefixes) == 1:
            # A split without a sample: one (empty) epoch, where megatron-core 0.16.1 would
            # loop forever looking for the samples asked of it (see the module docstring).
            sizes = [n if epoch_samples[0][i] else None for i, n in enumerate(sizes)]
        splits = BlendedMegatronDatasetBuilder(GPTDataset, sizes, on_rank, dataset_config).build()
    elif len(prefixes) == 1:
        builder = BlendedMegatronDatasetBuilder(GPTDataset, [None] * 3, on_rank, dataset_config)
        splits = builder.build()
    else:
        splits = _build_blend(prefixes, weights, epoch_samples, dataset_config, on_rank)
    return tuple(None if d is not None and len(d) == 0 else d for d in splits)


def megatron_num_samples(config) -> List[int]:
    """The train/valid/test sizes Megatron-LM asks of its datasets (``--data_order
    megatron``): train_iters x GBS; (train_iters // eval_interval + 1) x eval_iters x GBS
    (an --eval_steps of 0 counts as one evaluation); eval_iters x GBS. GPTDataset's shuffle
    covers that many samples, so these flags set the order."""
    t, lg = config.training, config.logging
    gbs = t.global_batch_size
    evaluations = (t.train_iters // lg.eval_steps + 1) if lg.eval_steps else 1
    return [t.train_iters * gbs, evaluations * lg.eval_iters * gbs, lg.eval_iters * gbs]


def _describe(prefixes) -> str:
    return prefixes[0] if len(prefixes) == 1 else f"the blend of {len(prefixes)} prefixes"


@lru_cache(maxsize=None)
def _sequence_lengths(prefix: str, stamp: Tuple[int, int]):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # Keep the dataset alive while copying: its views die with its memory map.
    dataset = IndexedDataset(prefix)
    return dataset.sequence_lengths.copy()


def samples_per_split(prefix: str, config) -> List[int]:
    """One-epoch sample count of each split, by megatron's own arithmetic.

    GPT splits cut the document list (by megatron's rounding), and an epoch of n tokens
    yields (n - 1) // seq_length samples (each sample reads one extra token for the labels).
    """
    idx = prefix + ".idx"
    lengths = _sequence_lengths(prefix, (os.path.getsize(idx), os.stat(idx).st_mtime_ns))
    n_sequences = lengths.shape[0]  # megatron splits GPT data by sequence (= document here)
    counts = []
    for bounds in config.split_matrix:
        if bounds is None:
            counts.append(0)
            continue
        begin, end = (int(round(b * float(n_sequences))) for b in bounds)
        tokens = int(lengths[begin:end].sum())
        counts.append(max(0, (tokens - config.add_extra_token_to_sequence)
                          // config.sequence_length))
    return counts


def _build_blend(prefixes, weights, epoch_samples, config, on_rank):
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset

    surplus = config.mid_level_dataset_surplus
    n_splits = len(config.split_matrix)
    # Per split: the prefixes that hold a sample there, their weights, and what to ask of each.
    members, blend_weights, blend_sizes = [], [], []
    request = [[None] * n_splits for _ in prefixes]
    for i in range(n_splits):
        present = [j for j in range(len(prefixes)) if epoch_samples[j][i] > 0]
        members.append(present)
        if len(present) <= 1 or weights is None:
            # Unweighted, or a lone prefix: each present prefix contributes one epoch as is.
            blend_weights.append([epoch_samples[j][i] for j in present])
            blend_sizes.append(None)
            continue
        total = sum(weights[j] for j in present)
        share = {j: weights[j] / total for j in present}
        size = sum(epoch_samples[j][i] for j in present)
        targets = {j: math.ceil(size * share[j]) for j in present}
        for j in present:  # the margin megatron keeps so the blend never overdraws a prefix
            request[j][i] = math.ceil(targets[j] * (1 + surplus))
        blend_weights.append([share[j] for j in present])
        blend_sizes.append(sum(targets.values()))

    # The builder only checks and logs these; each prefix is asked for its own request below.
    sizes = [s if s is not None else sum(epoch_samples[j][i] for j in members[i])
             for i, s in enumerate(blend_sizes)]
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, on_rank, config)
    mids = [builder._build_megatron_dataset_splits(p, config.split_matrix, request[j])
            for j, p in enumerate(prefixes)]
    out = []
    for i in range(n_splits):
        present = members[i]
        if config.split_matrix[i] is None or not present:
            out.append(None)
        elif len(present) == 1:
            out.append(mids[present[0]][i])
        else:
            out.append(BlendedMegatronDatasetBuilder.build_generic_dataset(
                BlendedDataset, on_rank, True, [mids[j][i] for j in present],
                blend_weights[i], blend_sizes[i], config))
    return out


# ---- identity for the resume check ------------------------------------------------------

@lru_cache(maxsize=None)
def _file_identity(prefix: str, stamp: Tuple[int, int, int]) -> str:
    digest = hashlib.sha256()
    with open(prefix + ".idx", "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return f"{digest.hexdigest()}:{os.path.getsize(prefix + '.bin')}"


def index_identity(prefix: str) -> str:
    """sha256 of the .idx (lengths and offsets of every document) plus the .bin size: what
    megatron's index arrays depend on (the cache folder's key), not the tokens.

    Cheap (the .idx is ~16 bytes per document) and independent of where the files live.
    """
    idx = prefix + ".idx"
    stat = os.stat(idx)
    bin_size = os.path.getsize(prefix + ".bin")
    return _file_identity(prefix, (stat.st_size, stat.st_mtime_ns, bin_size))


def prefix_identity(prefix: str) -> Tuple[str, Optional[str]]:
    """(index identity + sampled hash of the .bin, index identity + the .bin's full sha256
    from a valid PREFIX.hash.json or None): see indexed.bin_content and docs/data.md."""
    from .indexed import bin_content

    base = index_identity(prefix)
    sampled, full = bin_content(prefix)
    return f"{base}:sampled:{sampled}", f"{base}:sha256:{full}" if full else None


def fingerprints_match(saved, current) -> bool:
    """Whether a saved data fingerprint names the same data as the current one.

    A GPT data fingerprint (``dataset_fingerprint``) is ``2:<sampled>:<full>:<legacy>``:
    *sampled* hashes the .idx of every prefix and sampled blocks of its .bin; *full* hashes
    the .idx and the sha256 of every whole .bin, and is ``-`` unless every prefix has a
    valid PREFIX.hash.json; *legacy* is (the first half of) the fingerprint swift-mcore
    computed before the .bin was covered (.idx and .bin size), which a checkpoint saved
    then holds. Two fingerprints compare on *full* when both have it, else on *sampled*,
    so a copy of a prefix without its hash record still matches. Any other kind of
    fingerprint (finetuning data) must be equal.
    """
    if saved == current:
        return True
    parts = current.split(":") if isinstance(current, str) else []
    if not isinstance(saved, str) or len(parts) != 4 or parts[0] != "2":
        return False
    _, sampled, full, legacy = parts
    if len(saved) == 64 and ":" not in saved:
        return saved[:len(legacy)] == legacy
    then = saved.split(":")
    if len(then) != 4 or then[0] != "2":
        return False
    if then[2] != "-" and full != "-":
        return then[2] == full
    return then[1] == sampled


def dataset_fingerprint(dataset_or_args, tokenizer=None) -> str:
    """Identity of the data a run trains on: the prefixes' content (the .idx and the .bin
    tokens), the blend weights, the split and the tokenizer; a run resumed on different
    data shows a value that does not match (``fingerprints_match``, which says how).

    Accepts a dataset from ``build_datasets`` (any split), a GPTDatasetConfig, or the
    arguments (then the tokenizer is built unless given). --seq_length and --seed are left
    out on purpose: the resume check compares them itself and can then name the right flag.
    """
    if isinstance(getattr(dataset_or_args, "fingerprint", None), str):
        return dataset_or_args.fingerprint  # a finetuning dataset (data/sft_datasets.py) knows its own
    config = getattr(dataset_or_args, "config", None)
    if config is None and hasattr(dataset_or_args, "blend"):
        config = dataset_or_args
    if config is None:
        from .tokenizer import build_tokenizer

        args = dataset_or_args
        tokenizer = tokenizer or build_tokenizer(args)
        config = gpt_config(args, tokenizer, resolve_blend(args, tokenizer))
    prefixes, weights = config.blend
    total = sum(weights) if weights else None

    def digest(version: int, data: List[str]) -> str:
        description = {
            "version": version,
            "data": data,
            "weights": [w / total for w in weights] if weights else None,
            "split": config.split_matrix,
            "tokenizer": config.tokenizer.fingerprint,
        }
        return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()

    identities = [prefix_identity(p) for p in prefixes]
    sampled = digest(2, [s for s, _ in identities])[:32]
    full = "-"
    if all(f is not None for _, f in identities):
        full = digest(2, [f for _, f in identities])[:32]
    legacy = digest(1, [index_identity(p) for p in prefixes])[:32]
    return f"2:{sampled}:{full}:{legacy}"
