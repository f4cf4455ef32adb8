"""Helpers shared by the data tests: generated documents and small resolved runs."""

import random

from swift_mcore.arguments import RunArguments

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega def class return "
         "import yield while for if else print self value data 0 1 2 42 ( ) : = + -").split()


def make_documents(n_docs: int, seed: int, min_words: int = 20, max_words: int = 200):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            for _ in range(n_docs)]


def make_flags(tmp_path, **flags):
    defaults = dict(seq_length=32, micro_batch_size=2, global_batch_size=8, num_workers=0,
                    output_dir=str(tmp_path / "out"), seed=1234)
    return RunArguments.from_flags(**{**defaults, **flags})


def make_args(tmp_path, world_size=1, **flags):
    """The RunConfig of these flags on ``world_size`` ranks (what the data modules read)."""
    from swift_mcore.run_config import resolve

    return resolve(make_flags(tmp_path, **flags), world_size=world_size)


def raw_prefix(patterns, text_key, tokenizer, flag="--dataset"):
    """--dataset patterns, expanded as resolve does, tokenized into their cached prefix."""
    from swift_mcore.data import token_cache
    from swift_mcore.data.sources import expand_inputs

    return token_cache.raw_files_prefix(expand_inputs(patterns, flag), text_key, tokenizer)
