"""A random-weight Mistral 3 checkpoint (Pixtral vision tower with 2-D rotary positions, the projector's patch
merger, a Mistral decoder) and its image processor, as vision_checkpoints.py builds LLaVA's: the same word tokenizer
and chat template, the image token "<image>" (id V), the row break "[IMG_BREAK]" (V + 1) and "[IMG_END]" (V + 2).
Images are at most IMAGE_SIDE pixels a side (the processor's longest_edge): a program image is 64 x 64, 8 x 8
patches of 8 pixels merged 2 x 2 into 4 rows of 4 image tokens."""

from __future__ import annotations

from pathlib import Path

from benchmarks.vision_checkpoints import CHAT_TEMPLATE, IMAGE_TOKEN, TINY_TEXT, word_tokenizer

IMAGE_SIDE = 64
BREAK, END = "[IMG_BREAK]", "[IMG_END]"
TINY_PIXTRAL = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, head_dim=8, image_size=IMAGE_SIDE, patch_size=8, initializer_range=0.2)


def build_mistral3(directory: Path, vocab_size: int = 128, seed: int = 7) -> Path:
    """`directory` holding the checkpoint, its image processor and tokenizer."""
    import torch
    import transformers as T

    config = T.Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=vocab_size + 3, tie_word_embeddings=False, pad_token_id=0,
                         bos_token_id=None, eos_token_id=None, sliding_window=None, **TINY_TEXT),
        vision_config=dict(TINY_PIXTRAL), image_token_index=vocab_size, spatial_merge_size=2,
        vision_feature_layer=-1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = T.Mistral3ForConditionalGeneration(config).eval()
    images = T.PixtralImageProcessorPil(size={"longest_edge": IMAGE_SIDE}, patch_size={"height": 8, "width": 8})
    tokenizer = word_tokenizer(vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, BREAK, END]})
    tokenizer.chat_template = CHAT_TEMPLATE
    directory = Path(directory)
    model.save_pretrained(directory)
    images.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
