"""The built-in model's tokenizer: byte-level BPE trained here, on the built-in corpus.

Byte-level means every UTF-8 string encodes and decodes back unchanged, whatever characters it holds
(a character outside the corpus falls back to its bytes). Encoding adds BOS in front, as Llama-family
tokenizers do; the chat template starts with BOS itself and is tokenized without special tokens.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from backends.mlx.llm.builtin.corpus import EOS_TEXT, ROLE_TEXT

PAD, BOS, EOS = "<|pad|>", "<|bos|>", EOS_TEXT
# Ids 0.. in this order; the role markers are special so that user text can never spell one by accident.
SPECIAL_TOKENS = (PAD, BOS, EOS, ROLE_TEXT["system"], ROLE_TEXT["user"], ROLE_TEXT["assistant"])

# Each message is "<|role|>\ncontent<|eos|>", messages joined by "\n"; the assistant's reply is generated
# after "\n<|assistant|>\n" and ends with EOS, so a decode loop that stops at EOS stops at the turn's end.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('the built-in chat template knows the roles system, user and assistant') }}"
    "{% endif %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n<|assistant|>\\n' }}{% endif %}"
)


def train_tokenizer(documents: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    if not isinstance(vocab_size, int) or vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be an int above {256 + len(SPECIAL_TOKENS)} (the bytes and special "
                         f"tokens), got {vocab_size!r}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Markers are ids of their own: strip them from the text the merges are learned from.
    tok.train_from_iterator((_without_markers(doc) for doc in documents), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE, model_max_length=None)


def _without_markers(text: str) -> str:
    for marker in SPECIAL_TOKENS:
        text = text.replace(marker, "\n")
    return text
