"""Perplexity of a causal LM over the built-in corpus, to state what quantization costs.

Runs the eager model (quantized layers through their host references, which use the same integers,
scales and biases as the delegate) over the corpus' token stream in windows of `window` tokens.
"""

from __future__ import annotations

import math

import torch

from backends.mlx.llm.builtin.corpus import load_documents
from backends.mlx.llm.builtin.training import token_stream


def corpus_perplexity(model, tokenizer, documents: int = 200, window: int = 128) -> float:
    docs = load_documents()[:documents]
    encoded = [tokenizer(doc, add_special_tokens=False)["input_ids"] for doc in docs]
    stream = token_stream(encoded, tokenizer.bos_token_id, tokenizer.eos_token_id)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, window):
            chunk = stream[start:start + window + 1].unsqueeze(0)
            if chunk.shape[1] < 2:
                break
            logits = model(chunk[:, :-1]).logits.float()
            total += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    return math.exp(total / count)
