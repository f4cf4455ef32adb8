"""Token-by-token generation from a full model: greedy, or temperature with nucleus (top-p).

Every step runs the whole sequence again (no key/value cache): simple and exact, meant for
looking at what a model learned, not for serving.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional

import torch

Logits = Callable[[torch.Tensor], torch.Tensor]  # tokens [1, s] -> logits [1, s, vocab]


def next_token(logits: torch.Tensor, temperature: float, top_p: float,
               generator: Optional[torch.Generator]) -> int:
    """One token from the last position's logits [vocab]."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep a token while the mass before it is below top_p: the smallest such set
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def generate(logits_fn: Logits, prompt: List[int], max_new_tokens: int, vocab: int,
             eos: Optional[int] = None, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, max_length: Optional[int] = None) -> Iterator[int]:
    """Yields new tokens one at a time; stops after ``eos``, ``max_new_tokens`` or when the
    sequence reaches ``max_length``. Rows of the padded vocabulary are never chosen."""
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        if max_length is not None and len(tokens) >= max_length:
            return
        logits = logits_fn(torch.tensor([tokens]))[0, -1, :vocab].cpu()
        token = next_token(logits, temperature, top_p, generator)
        tokens.append(token)
        yield token
        if token == eos:
            return
