"""A small random-weight Llama with a byte-level BPE tokenizer trained here, exported as a decoder
.pte: what the serving tests and `etmlx bench serve` run against when no checkpoint is given.

Nothing is downloaded: the tokenizer learns its merges from the text below, and the weights are
random (seeded), so the output is noise made of real tokens, which is all serving needs.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
EOS = "<|endoftext|>"
_TEXT = """The quick brown fox jumps over the lazy dog. A server loads a program once and answers many
clients. Each request joins the running batch at the next step, with its own temperature, seed and
position. Tokens stream back as text; multi-byte characters such as é, ü, 日本 and emoji 🙂 arrive whole.
Hello there! How are you today? Once upon a time, in a land far away, there lived a small model that
predicted the next token. It was not very wise, but it was quick, and it never tired of counting."""


def train_tokenizer(vocab_size: int = 320):
    """A transformers fast tokenizer (byte-level BPE) with an end-of-text token and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TEXT.splitlines() * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(vocab_size: int, eos_token_id: int, hidden: int = 64, layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, eos_token_id=eos_token_id, bos_token_id=None)
    return LlamaForCausalLM(config).eval()


def export_tiny(out: Path, *, batch: int = 4, max_seq_len: int = 64, hidden: int = 64, layers: int = 2,
                logprobs: int = 5, logit_bias: int = 4, penalties: bool = True, progress=None):
    """Export the tiny model with the sampler features the server exposes; returns the .pte path."""
    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.sampler.config import SamplerConfig

    tokenizer = train_tokenizer()
    model = tiny_llama(len(tokenizer), tokenizer.eos_token_id, hidden=hidden, layers=layers)
    config = SamplerConfig(top_k=True, top_p=True, min_p=True, logit_bias=logit_bias, logprobs=logprobs,
                           penalties=penalties)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    export_decoder(model, out, max_seq_len, config=config, batch=batch, tokenizer=tokenizer, progress=progress)
    return out
