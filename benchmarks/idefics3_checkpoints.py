"""Random-weight Idefics3 / SmolVLM checkpoints (SigLIP-style vision tower, pixel-shuffle connector, Llama decoder)
with their processors, for tests: transformers' own classes from configs, saved with save_pretrained.

The tokenizer is vision_checkpoints.py's word-level one plus the tile prompt's tokens: <fake_token_around_image>,
<global-img>, <end_of_utterance>, <row_r_col_c> and the newlines "\\n", "\\n\\n" as words (a prompt is split on
spaces only, so the processor's newlines between tile rows are tokens the test can see).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.vision_checkpoints import CHAT_TEMPLATE, IMAGE_TOKEN, TINY_TEXT, TINY_VISION

FAKE, GLOBAL, END = "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"
MAX_GRID = 4  # <row_r_col_c> tokens for r, c <= MAX_GRID


def tile_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [IMAGE_TOKEN, FAKE, GLOBAL, END] + [f"<row_{r}_col_{c}>" for r in range(1, MAX_GRID + 1)
                                                   for c in range(1, MAX_GRID + 1)]
    vocab = {f"t{i}": i for i in range(vocab_size)}
    for word in specials + ["\n", "\n\n"]:
        vocab[word] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.Split(" ", "removed")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0",
                                        extra_special_tokens={"image_token": IMAGE_TOKEN})
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def build_idefics3(directory: Path, family: str = "idefics3", vocab_size: int = 128, tile: int = 32,
                   longest_edge: int = 64, splitting: bool = True, seed: int = 7) -> Path:
    """An Idefics3 (family "idefics3") or SmolVLM ("smolvlm") checkpoint in `directory`: tiles of `tile` pixels
    (the vision tower's image size), images resized to `longest_edge` first (so up to (longest_edge / tile)^2
    tiles plus the whole image), `splitting`: the processor's do_image_splitting."""
    import torch
    import transformers as T

    tokenizer = tile_tokenizer(vocab_size)
    vision = {**TINY_VISION, "image_size": tile}
    scale = 2
    seq_len = (tile // vision["patch_size"]) ** 2 // scale ** 2
    text_config = T.LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, pad_token_id=0,
                                bos_token_id=None, eos_token_id=None, **TINY_TEXT)
    names = {"idefics3": ("Idefics3", "Idefics3"), "smolvlm": ("SmolVLM", "SmolVLM")}[family]
    config = getattr(T, names[0] + "Config")(vision_config=vision, text_config=text_config.to_dict(),
                                             scale_factor=scale, image_token_id=vocab_size, pad_token_id=0)
    torch.manual_seed(seed)
    model = getattr(T, names[0] + "ForConditionalGeneration")(config).eval()
    image_processor = getattr(T, names[1] + "ImageProcessor")(size={"longest_edge": longest_edge},
                                                               max_image_size={"longest_edge": tile},
                                                               do_image_splitting=splitting)
    directory = Path(directory)
    model.save_pretrained(directory)
    if family == "smolvlm":  # SmolVLMProcessor needs torchvision and num2words: its parts saved one by one
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(directory)
        image_processor.save_pretrained(directory)
    else:
        T.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len,
                            chat_template=CHAT_TEMPLATE).save_pretrained(directory)
    return directory


def reference_processor(directory: Path):
    """transformers' processor for a checkpoint build_idefics3 wrote: SmolVLM's image prompt is Idefics3's, so
    a SmolVLM checkpoint gets an Idefics3Processor over its own image processor and tokenizer."""
    import transformers as T

    config = T.AutoConfig.from_pretrained(str(directory))
    if config.model_type == "idefics3":
        return T.AutoProcessor.from_pretrained(str(directory))
    vision = config.vision_config
    return T.Idefics3Processor(image_processor=T.AutoImageProcessor.from_pretrained(str(directory)),
                               tokenizer=T.AutoTokenizer.from_pretrained(str(directory)),
                               image_seq_len=(vision.image_size // vision.patch_size) ** 2 // config.scale_factor ** 2,
                               chat_template=CHAT_TEMPLATE)
