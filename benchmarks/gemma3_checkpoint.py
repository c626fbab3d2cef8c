"""A random-weight Gemma 3 multimodal checkpoint (SigLIP tower, the projector's average pooling to
mm_tokens_per_image, a Gemma 3 decoder with sliding and full layers) with its processor, for tests.

The tokenizer is a word-level one over "t0".."t{V-1}" plus Gemma 3's image tokens: "<start_of_image>" (V, what the
chat template writes for an image part), "<image_soft_token>" (V + 1, the image's positions) and "<end_of_image>"
(V + 2). The processor replaces each "<start_of_image>" with its full image sequence (boi, the image tokens, eoi).
"""

from __future__ import annotations

from pathlib import Path

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
                 "{% for c in m['content'] %}{% if c['type'] == 'image' %}" + BOI + " {% else %}{{ c['text'] }} "
                 "{% endif %}{% endfor %}{% endif %}{% endfor %}")
# Sharp weights (as tests/test_model_families.py); a sliding window narrower than one image's tokens, so the
# image block and the window meet in the sliding layer's mask.
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
                 sliding_window=12, layer_types=["sliding_attention", "full_attention"])
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=64,
                   patch_size=8, initializer_range=0.2)
TOKENS_PER_IMAGE = 16  # 8 x 8 patches pooled 2 x 2


def gemma3_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab.update({BOI: vocab_size, IMAGE: vocab_size + 1, EOI: vocab_size + 2})
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0",
                                        extra_special_tokens={"boi_token": BOI, "image_token": IMAGE,
                                                              "eoi_token": EOI})
    tokenizer.add_special_tokens({"additional_special_tokens": [BOI, IMAGE, EOI]})
    return tokenizer


def build_gemma3(directory: Path, vocab_size: int = 128, seed: int = 7) -> Path:
    """A Gemma3ForConditionalGeneration checkpoint and its processor in `directory`; the text vocabulary is
    `vocab_size` words, the image token id vocab_size + 1."""
    import torch
    import transformers as T

    text_config = T.Gemma3TextConfig(vocab_size=vocab_size + 3, pad_token_id=0, bos_token_id=None,
                                     eos_token_id=None, tie_word_embeddings=False,
                                     **TINY_TEXT)
    vision_config = T.SiglipVisionConfig(**TINY_VISION)
    config = T.Gemma3Config(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False,
                            mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=vocab_size,
                            image_token_index=vocab_size + 1, eoi_token_index=vocab_size + 2)
    torch.manual_seed(seed)
    model = T.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the projector starts at zeros: random, so the image reaches the tokens
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        projection.normal_(0, 0.5)
    size = TINY_VISION["image_size"]
    processor = T.Gemma3Processor(image_processor=T.Gemma3ImageProcessor(size={"height": size, "width": size}),
                                  tokenizer=gemma3_tokenizer(vocab_size), chat_template=CHAT_TEMPLATE,
                                  image_seq_length=TOKENS_PER_IMAGE)
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
