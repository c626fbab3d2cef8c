"""llm/vision/preprocess.py equals transformers' image processors (its PIL backend, transformers' choice without
torchvision): the same shapes and pixel_values within 1e-6 absolute (the same steps in the same precision; the
figures come out bit-equal), the family's extras equal, for several sizes and aspect ratios and the settings of
real checkpoints; unknown processors and unsupported settings refused in one line."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
import transformers
from PIL import Image

from backends.mlx.llm.vision.preprocess import PreprocessError, check_config, files_config, preprocess

ATOL = 1e-6
# (width, height): landscape, portrait, square, odd, tall and thin, wide and thin, tiny, larger than a tile grid
SIZES = [(640, 480), (480, 640), (224, 224), (333, 517), (90, 1300), (1000, 37), (17, 23), (1500, 900)]


def _image(width: int, height: int, seed: int) -> Image.Image:
    """Smooth gradients plus noise: resampling filters see both edges and flat regions."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


IMAGES = [_image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]

# name -> (transformers PIL class, settings as a checkpoint's preprocessor_config.json has them)
CASES = {
    "llava-1.5 (CLIP)": ("CLIPImageProcessorPil", {"size": {"shortest_edge": 336},
                                                   "crop_size": {"height": 336, "width": 336}}),
    "clip defaults": ("CLIPImageProcessorPil", {}),
    "llava padded to a square": ("LlavaImageProcessorPil", {"do_pad": True, "size": {"shortest_edge": 336},
                                                            "crop_size": {"height": 336, "width": 336}}),
    "llava-next (anyres)": ("LlavaNextImageProcessorPil", {"size": {"shortest_edge": 336},
                                                           "crop_size": {"height": 336, "width": 336}}),
    "llava-onevision (anyres_max_9)": ("LlavaOnevisionImageProcessorPil", {}),
    "llava-onevision small tiles": ("LlavaOnevisionImageProcessorPil", {
        "size": {"height": 224, "width": 224}, "image_grid_pinpoints": [[224, 224], [224, 448], [448, 224], [448, 448]],
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}),
    "siglip 384": ("SiglipImageProcessorPil", {"size": {"height": 384, "width": 384}}),
    "gemma 3": ("Gemma3ImageProcessorPil", {"size": {"height": 896, "width": 896}, "do_pan_and_scan": False}),
    "idefics3 defaults": ("Idefics3ImageProcessorPil", {}),
    "idefics3 without splitting": ("Idefics3ImageProcessorPil", {"do_image_splitting": False}),
    "smolvlm-256m": ("SmolVLMImageProcessorPil", {"size": {"longest_edge": 2048},
                                                  "max_image_size": {"longest_edge": 512}}),
    "qwen2-vl defaults": ("Qwen2VLImageProcessorPil", {}),
    "qwen2-vl few pixels": ("Qwen2VLImageProcessorPil", {"min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28}),
    "qwen2-vl many pixels": ("Qwen2VLImageProcessorPil", {"min_pixels": 512 * 28 * 28}),
}


def _reference(cls_name: str, settings: dict):
    return getattr(transformers, cls_name)(**settings)


def _compare(ours, theirs, names):
    assert ours.pixel_values.dtype == np.float32
    expected = np.asarray(theirs["pixel_values"])
    assert ours.pixel_values.shape == expected.shape
    np.testing.assert_allclose(ours.pixel_values, expected, rtol=0, atol=ATOL)
    for name in names:
        assert np.array_equal(ours.extras[name], np.asarray(theirs[name])), name


def _extras(cls_name: str) -> list[str]:
    return {"Idefics3ImageProcessorPil": ["pixel_attention_mask", "rows", "cols"],
            "SmolVLMImageProcessorPil": ["pixel_attention_mask", "rows", "cols"],
            "Qwen2VLImageProcessorPil": ["image_grid_thw"], "Gemma3ImageProcessorPil": ["num_crops"],
            "LlavaNextImageProcessorPil": ["image_sizes"],
            "LlavaOnevisionImageProcessorPil": ["image_sizes", "batch_num_images"]}.get(cls_name, [])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("index", range(len(IMAGES)))
def test_one_image_equals_transformers(case, index):
    cls_name, settings = CASES[case]
    reference = _reference(cls_name, settings)
    image = IMAGES[index]
    extra = {"return_row_col_info": True} if "rows" in _extras(cls_name) else {}
    theirs = reference([image], return_tensors="np", **extra)
    ours = preprocess([image], reference.to_dict())  # the configuration as the checkpoint would store it
    _compare(ours, theirs, _extras(cls_name))


@pytest.mark.parametrize("case", sorted(CASES))
def test_several_images_of_one_prompt_equal_transformers(case):
    cls_name, settings = CASES[case]
    reference = _reference(cls_name, settings)
    images = [IMAGES[0], IMAGES[3], IMAGES[5]]
    extra = {"return_row_col_info": True} if "rows" in _extras(cls_name) else {}
    # their batch: one list of images per prompt (LLaVA-OneVision's then one tile each, padded with the mean colour)
    nested = cls_name.startswith(("Idefics3", "SmolVLM", "LlavaOnevision"))
    theirs = reference([images] if nested else images, return_tensors="np", **extra)
    _compare(preprocess(images, reference.to_dict()), theirs, _extras(cls_name))


@pytest.mark.parametrize("cls_name", sorted({c for c, _ in CASES.values()}))
def test_the_class_defaults_are_transformers(cls_name):
    """A configuration naming only the type gets the defaults transformers' class has."""
    reference = _reference(cls_name, {})
    theirs = reference([IMAGES[3]], return_tensors="np")
    ours = preprocess([IMAGES[3]], {"image_processor_type": reference.to_dict()["image_processor_type"]})
    np.testing.assert_allclose(ours.pixel_values, np.asarray(theirs["pixel_values"]), rtol=0, atol=ATOL)


def test_a_wrong_setting_would_be_caught():
    """Control: the comparison sees a changed resampling filter (bicubic vs bilinear) on these images."""
    reference = _reference("CLIPImageProcessorPil", {})
    theirs = np.asarray(reference([IMAGES[0]], return_tensors="np")["pixel_values"])
    ours = preprocess([IMAGES[0]], {**reference.to_dict(), "resample": 2}).pixel_values
    assert np.abs(ours - theirs).max() > 100 * ATOL


def test_qwen2_vl_image_tokens_are_the_processors():
    reference = _reference("Qwen2VLImageProcessorPil", {})
    ours = preprocess(IMAGES[:4], reference.to_dict())
    merge = reference.merge_size ** 2
    assert ours.image_tokens == [reference.get_number_of_image_patches(i.height, i.width) // merge
                                 for i in IMAGES[:4]]
    assert ours.image_tokens == [int(g.prod()) // merge for g in ours.extras["image_grid_thw"]]


def test_idefics3_image_tokens_follow_the_tiles():
    reference = _reference("SmolVLMImageProcessorPil", {"size": {"longest_edge": 2048},
                                                        "max_image_size": {"longest_edge": 512}})
    processor = {"image_processor": reference.to_dict(), "image_seq_len": 64}  # processor.to_dict()'s shape
    images = [IMAGES[0], IMAGES[6]]  # 640 x 480: split into tiles; 17 x 23: split too (resized up to 2048 first)
    ours = preprocess(images, processor)
    expected = []
    for image in images:
        tiles, rows, cols = reference.get_number_of_image_patches(image.height, image.width)
        expected.append(64 * (tiles or 1))
        assert (rows, cols) == (ours.extras["rows"][0, len(expected) - 1], ours.extras["cols"][0, len(expected) - 1])
    assert ours.image_tokens == expected
    assert ours.pixel_values.shape[1] == sum(t // 64 for t in expected)


def test_llava_and_gemma3_image_tokens():
    clip = _reference("CLIPImageProcessorPil", CASES["llava-1.5 (CLIP)"][1]).to_dict()
    llava = {"image_processor": clip, "patch_size": 14, "num_additional_image_tokens": 1,
             "vision_feature_select_strategy": "default"}
    assert preprocess(IMAGES[:2], llava).image_tokens == [576, 576]  # LLaVA 1.5: 24 x 24 patches
    assert preprocess(IMAGES[:1], clip).image_tokens is None  # the image processor alone does not say
    gemma = {"image_processor": _reference("Gemma3ImageProcessorPil", {}).to_dict(), "image_seq_length": 256}
    assert preprocess(IMAGES[:3], gemma).image_tokens == [256] * 3


@pytest.mark.parametrize("config, words", [
    ({"image_processor_type": "ChameleonImageProcessor"}, ["ChameleonImageProcessor", "not supported"]),
    ({}, ["None", "not supported"]),
    ({"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": True}, ["pan and scan"]),
    ({"image_processor_type": "CLIPImageProcessor", "size": {"longest_edge": 300}}, ["size"]),
    ("CLIPImageProcessor", ["must be a dict"]),
])
def test_unsupported_configurations_are_refused_in_one_line(config, words):
    with pytest.raises(PreprocessError) as info:
        check_config(config) if "size" not in str(config) else preprocess([IMAGES[0]], config)
    assert "\n" not in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_bad_images_are_refused():
    config = {"image_processor_type": "Qwen2VLImageProcessor"}
    with pytest.raises(PreprocessError, match="aspect ratio"):
        preprocess([Image.new("RGB", (4000, 10))], config)
    with pytest.raises(PreprocessError, match="RGB"):
        preprocess([Image.new("RGBA", (40, 10))], config)
    with pytest.raises(PreprocessError, match="no images"):
        preprocess([], config)


def test_a_preprocessor_config_json_as_checkpoints_write_it():
    """Qwen2-VL-2B-Instruct's preprocessor_config.json keeps min_pixels / max_pixels beside no `size`; the
    processor built from the same keys gives the same values."""
    config = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
              "min_pixels": 3136, "max_pixels": 200 * 28 * 28, "patch_size": 14, "temporal_patch_size": 2,
              "merge_size": 2, "do_rescale": True, "rescale_factor": 0.00392156862745098, "do_normalize": True,
              "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
              "resample": 3, "do_convert_rgb": True, "do_resize": True}
    reference = _reference("Qwen2VLImageProcessorPil", {k: v for k, v in config.items()
                                                        if k not in ("image_processor_type", "processor_class")})
    images = [IMAGES[0], IMAGES[7]]
    _compare(preprocess(images, config), reference(images, return_tensors="np"), ["image_grid_thw"])


def test_llava_next_image_tokens_are_the_processors():
    """Each image's feature count from LlavaNextProcessor's own formula (base tile, unpadded grid, newlines)."""
    image_processor = _reference("LlavaNextImageProcessorPil", CASES["llava-next (anyres)"][1])
    settings = {"patch_size": 14, "num_additional_image_tokens": 1, "vision_feature_select_strategy": "default"}
    theirs = types.SimpleNamespace(image_processor=image_processor, **settings)
    theirs._get_unpadded_features = functools.partial(transformers.LlavaNextProcessor._get_unpadded_features, theirs)
    ours = preprocess(IMAGES, {"image_processor": image_processor.to_dict(), **settings})
    expected = [transformers.LlavaNextProcessor._get_number_of_features(theirs, i.height, i.width, 336, 336) - 1
                for i in IMAGES]
    assert ours.image_tokens == expected
    assert len(set(expected)) > 2  # the sizes reach different grids


def test_llava_onevision_image_tokens_are_the_processors():
    """Each image's feature count from LlavaOnevisionProcessor's own code: alone, anyres_max_4's shrunk grid (the
    sizes here reach grids that are and are not shrunk); two in one prompt, one tile and a newline each."""
    from benchmarks.vision_checkpoints import onevision_processor, word_tokenizer

    image_processor = _reference("LlavaOnevisionImageProcessorPil", {})
    settings = {"num_image_tokens": 729, "vision_feature_select_strategy": "full",
                "vision_aspect_ratio": "anyres_max_4"}
    theirs = onevision_processor(image_processor, word_tokenizer(8), **settings)
    config = {"image_processor": image_processor.to_dict(), **settings}
    expected = [theirs._get_number_of_features(i.height, i.width, 384, 384) for i in IMAGES]
    assert [preprocess([i], config).image_tokens[0] for i in IMAGES] == expected
    unshrunk = [preprocess([i], {**config, "vision_aspect_ratio": "anyres_max_99"}).image_tokens[0] for i in IMAGES]
    assert 0 < sum(a < b for a, b in zip(expected, unshrunk)) < len(IMAGES)
    two = theirs(text="<image> <image>", images=[[IMAGES[0], IMAGES[7]]], return_tensors="np")
    assert preprocess([IMAGES[0], IMAGES[7]], config).image_tokens == [730, 730]
    assert int((two["input_ids"] == 8).sum()) == 2 * 730
    with pytest.raises(PreprocessError, match="vision_aspect_ratio 'anyres' is not supported"):
        preprocess([IMAGES[0]], {**config, "vision_aspect_ratio": "anyres"})


def test_split_processor_files_are_merged_as_the_nested_form():
    """Older checkpoints (llava-hf's LLaVA-OneVision) keep the processor's keys in processor_config.json and the image
    processor in preprocessor_config.json; transformers 5 nests both in processor_config.json. Both read alike."""
    import json

    image_processor = json.loads(json.dumps(_reference("LlavaOnevisionImageProcessorPil", {}).to_dict()))
    outer = {"num_image_tokens": 729, "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9",
             "processor_class": "LlavaOnevisionProcessor"}
    split = {"processor_config.json": json.dumps(outer).encode(),
             "preprocessor_config.json": json.dumps(image_processor).encode()}
    nested = {"processor_config.json": json.dumps({**outer, "image_processor": image_processor}).encode()}
    assert files_config(split) == files_config(nested) == {**outer, "image_processor": image_processor}
    assert preprocess([IMAGES[0]], files_config(split)).image_tokens[0] > 729
    alone = {"preprocessor_config.json": json.dumps(image_processor).encode()}
    assert files_config(alone) == image_processor and files_config({}) is None
