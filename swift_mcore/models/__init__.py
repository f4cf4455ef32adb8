"""Models: the GPT builder, Hugging Face families, weight conversion, export and generation."""
