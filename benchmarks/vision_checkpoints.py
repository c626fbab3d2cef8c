"""Random-weight vision-language checkpoints (model, tokenizer, processor, chat template) that tests and
`etmlx bench vision` build: transformers' own classes from configs, saved with save_pretrained.

The tokenizer is a word-level one over "t0".."t{V-1}" plus the image token "<image>" (id V): prompts are written as
those words, so every id is chosen by the test. The chat template renders text parts as they are and an image
part as "<image>", which the processor (and etmlx) expand to the image's positions.
"""

from __future__ import annotations

from pathlib import Path

IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
                 "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} "
                 "{% endif %}{% endfor %}{% endif %}{% endfor %}")
# Sharp weights (as tests/test_model_families.py): at transformers' default init the logits are nearly flat.
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                   patch_size=8, initializer_range=0.2)


def word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab[IMAGE_TOKEN] = vocab_size
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0",
                                        extra_special_tokens={"image_token": IMAGE_TOKEN})
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tokenizer


def build_llava(directory: Path, vocab_size: int = 128, text: dict | None = None, vision: dict | None = None,
                seed: int = 7) -> Path:
    """A LLaVA 1.5 checkpoint (CLIP vision tower, MLP projector, Llama decoder) with its processor in
    `directory`; the text vocabulary is `vocab_size` words, the image token id vocab_size."""
    import torch
    import transformers as T

    text = {**TINY_TEXT, **(text or {})}
    vision = {**TINY_VISION, **(vision or {})}
    # the embedding holds the image token's row too (LLaVA embeds it, then overwrites it)
    text_config = T.LlamaConfig(vocab_size=vocab_size + 2, tie_word_embeddings=False, pad_token_id=0,
                                bos_token_id=None, eos_token_id=None, **text)
    vision_config = T.CLIPVisionConfig(projection_dim=vision["hidden_size"], **vision)
    config = T.LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_id=vocab_size,
                           projector_hidden_act="gelu", vision_feature_layer=-2,
                           vision_feature_select_strategy="default",
                           image_seq_length=(vision["image_size"] // vision["patch_size"]) ** 2)
    torch.manual_seed(seed)
    model = T.LlavaForConditionalGeneration(config).eval()
    size = vision["image_size"]
    processor = T.LlavaProcessor(
        image_processor=T.CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
        tokenizer=word_tokenizer(vocab_size), patch_size=vision["patch_size"], vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


LLAVA_NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # grids of tower-sized tiles: 1 x 2, 2 x 1, 2 x 2


def build_llava_next(directory: Path, vocab_size: int = 128, seed: int = 7) -> Path:
    """A LLaVA-NeXT ("anyres") checkpoint (CLIP tower, projector, image_newline, Llama decoder) with its processor in
    `directory`; tokenizer and chat template as build_llava's. The image_newline is drawn as large as the features
    so that a misplaced one changes tokens."""
    import torch
    import transformers as T

    vision = dict(TINY_VISION)
    size, patch = vision["image_size"], vision["patch_size"]
    text_config = T.LlamaConfig(vocab_size=vocab_size + 2, tie_word_embeddings=False, pad_token_id=0,
                                bos_token_id=None, eos_token_id=None, **TINY_TEXT)
    config = T.LlavaNextConfig(vision_config=T.CLIPVisionConfig(projection_dim=vision["hidden_size"], **vision),
                               text_config=text_config, image_token_id=vocab_size, projector_hidden_act="gelu",
                               vision_feature_layer=-2, vision_feature_select_strategy="default",
                               image_grid_pinpoints=LLAVA_NEXT_PINPOINTS, image_seq_length=(size // patch) ** 2)
    torch.manual_seed(seed)
    model = T.LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.image_newline.normal_(0, 1)
    crop = {"height": size, "width": size}
    image_processor = T.LlavaNextImageProcessorPil(size={"shortest_edge": size}, crop_size=crop,
                                                   image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    processor = T.LlavaNextProcessor(image_processor=image_processor, tokenizer=word_tokenizer(vocab_size),
                                     patch_size=patch, vision_feature_select_strategy="default",
                                     num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


# LLaVA-OneVision: 1 x 1, 1 x 2, 2 x 1 and 2 x 2 grids; "anyres_max_2" lets an unpadded grid picture hold 2 tiles'
# patches (x 1.1^2) before it is interpolated down, so a 2 x 2 grid shrinks and a 1 x 2 one does not.
ONEVISION_PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]


def onevision_processor(image_processor, tokenizer, **settings):
    """transformers' LlavaOnevisionProcessor without its video processor (which needs torchvision): images and
    text go through transformers' own code; `settings` are its num_image_tokens, vision_feature_select_strategy,
    vision_aspect_ratio, chat_template."""
    import transformers as T

    class ImagesOnly(T.LlavaOnevisionProcessor):
        def check_argument_for_proper_class(self, name, value):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, value)

    return ImagesOnly(image_processor=image_processor, tokenizer=tokenizer, **settings)


def load_onevision_processor(directory: Path):
    """The processor build_llava_onevision saved, as onevision_processor builds it."""
    import json

    import transformers as T

    saved = json.loads((Path(directory) / "processor_config.json").read_text())
    keys = ("num_image_tokens", "vision_feature_select_strategy", "vision_aspect_ratio")
    tokenizer = T.AutoTokenizer.from_pretrained(str(directory))
    return onevision_processor(T.AutoImageProcessor.from_pretrained(str(directory)), tokenizer,
                               chat_template=tokenizer.chat_template, **{k: saved[k] for k in keys})


def build_llava_onevision(directory: Path, vocab_size: int = 128, seed: int = 7,
                          aspect_ratio: str = "anyres_max_2") -> Path:
    """A LLaVA-OneVision checkpoint (SigLIP tower, all positions kept, projector, image_newline, Qwen2 decoder) with
    its processor's files in `directory` (processor_config.json as transformers writes it, the tokenizer with the
    chat template; no video processor); tokenizer and chat template as build_llava's, the video token id
    vocab_size + 1 outside the tokenizer. The image_newline is drawn as large as the features so that a misplaced
    one changes tokens."""
    import json

    import torch
    import transformers as T

    vision = dict(TINY_VISION)
    size, patch = vision["image_size"], vision["patch_size"]
    text_config = T.Qwen2Config(vocab_size=vocab_size + 2, tie_word_embeddings=False, pad_token_id=0,
                                bos_token_id=None, eos_token_id=None, **TINY_TEXT)
    config = T.LlavaOnevisionConfig(vision_config=T.SiglipVisionConfig(**vision), text_config=text_config,
                                    image_token_id=vocab_size, video_token_id=vocab_size + 1,
                                    vision_feature_layer=-1, vision_feature_select_strategy="full",
                                    image_grid_pinpoints=ONEVISION_PINPOINTS, vision_aspect_ratio=aspect_ratio)
    torch.manual_seed(seed)
    model = T.LlavaOnevisionForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.image_newline.normal_(0, 1)
    image_processor = T.LlavaOnevisionImageProcessorPil(size={"height": size, "width": size},
                                                        image_grid_pinpoints=ONEVISION_PINPOINTS)
    tokenizer = word_tokenizer(vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE
    processor = onevision_processor(image_processor, tokenizer, num_image_tokens=(size // patch) ** 2,
                                    vision_feature_select_strategy="full", vision_aspect_ratio=aspect_ratio)
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    saved = {k: v for k, v in processor.to_dict().items() if k not in ("video_processor", "chat_template")}
    saved["processor_class"] = "LlavaOnevisionProcessor"
    (directory / "processor_config.json").write_text(json.dumps(saved, indent=2))
    return directory
