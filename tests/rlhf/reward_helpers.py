"""Tiny reward models for the rm tests: a Hugging Face *ForSequenceClassification folder
built from a transformers config, and pairs with margins."""

import torch

import hf_helpers as H
from rlhf_helpers import ROWS

MARGINS = [0.5, 0.0, 1.25, -0.25]
MARGIN_ROWS = [{**row, "margin": m} for row, m in zip(ROWS, MARGINS)]


def make_score_model(path, model_type="llama", seed=0, **overrides):
    """A random transformers *ForSequenceClassification (num_labels 1) and its tokenizer,
    saved into ``path``; its pad token is the EOS, as TRL's RewardTrainer sets it."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    H.write_tokenizer(str(path))
    eos = AutoTokenizer.from_pretrained(str(path)).eos_token_id
    extra = dict(H.FAMILIES[model_type][1]) if model_type in H.FAMILIES else {}
    config = AutoConfig.for_model(H.FAMILIES.get(model_type, (model_type,))[0],
                                  **{**H.BASE, "initializer_range": 0.02, **extra,
                                     **overrides}, num_labels=1, pad_token_id=eos)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(
        config, attn_implementation="eager").float()
    model.save_pretrained(str(path))
    return model.eval()


def hf_scores(path, sequences):
    """transformers' scores [n] of token-id lists, right-padded with the pad token."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()
    pad = model.config.pad_token_id
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0]
