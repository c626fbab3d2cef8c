"""A random-weight Qwen2-VL or Qwen2.5-VL checkpoint (vision tower with 2-D rotary embeddings and patch merger, Qwen2
decoder with multimodal RoPE) and its processor, as vision_checkpoints.py builds LLaVA's: the same word tokenizer and
chat template, the image token "<image>" (id V). Qwen2.5-VL's tower has window attention: windows of 2 x 2 merged
tokens over the 3 x 3 grid of a program image (padded to 4 x 4: windows of 4, 2, 2 and 1 tokens), its middle block
attending to the whole image."""

from __future__ import annotations

from pathlib import Path

from benchmarks.vision_checkpoints import CHAT_TEMPLATE, TINY_TEXT, word_tokenizer

# patch 14 x merge 2: sides are multiples of 28; the processor resizes images into IMAGE_SIDE^2 pixels at most (a
# program of IMAGE_SIDE x IMAGE_SIDE images: 3 x 3 image tokens)
IMAGE_SIDE = 84
TINY_VISION = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.2)
TINY_VISION_2_5 = dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=4, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                       initializer_range=0.2)
FAMILIES = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", TINY_VISION),
            "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", TINY_VISION_2_5)}


def build_qwen2_vl(directory: Path, vocab_size: int = 128, side: int = IMAGE_SIDE, seed: int = 7,
                   family: str = "qwen2_vl") -> Path:
    """`directory` holding the checkpoint and its processor; images are resized into side x side pixels at most
    (the processor's max_pixels), the text's M-RoPE sections (2, 3, 3) over a head dim of 16. `family`: qwen2_vl or
    qwen2_5_vl."""
    import torch
    import transformers as T

    config_class, model_class, vision = FAMILIES[family]
    text = {k: v for k, v in TINY_TEXT.items()}
    config = getattr(T, config_class)(
        text_config=dict(vocab_size=vocab_size + 2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=None,
                         eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": [2, 3, 3]}, **text),
        vision_config=dict(vision), image_token_id=vocab_size,
        video_token_id=vocab_size + 1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(T, model_class)(config).eval()
    # transformers' Qwen2VLProcessor needs a video processor (torchvision): the image processor and the tokenizer
    # are saved on their own, which is all etmlx reads
    images = T.Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=side * side, patch_size=14, merge_size=2,
                                        temporal_patch_size=2)
    tokenizer = word_tokenizer(vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE
    directory = Path(directory)
    model.save_pretrained(directory)
    images.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
