"""Models: the GPT builder (and, later, Hugging Face model families)."""
