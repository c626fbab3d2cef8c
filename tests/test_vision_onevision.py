"""LLaVA-OneVision programs: LLaVA-NeXT's tiles and host packing (llm/decoder/llava_onevision.py) plus anyres_max_N,
which shrinks a large unpadded grid picture by bilinear interpolation, and one tile per image in a prompt with
several. A tiny random checkpoint (SigLIP tower, Qwen2 decoder; benchmarks/vision_checkpoints.py, "anyres_max_2")
through `etmlx export --model`, then a chat with an image decodes transformers' own greedy `generate` with its
processor's inputs (float), or tokens the float model ranks within INT8_NATS of its best (`--quantize int8`).
The images: 40 x 70 (2 x 2 tiles, unpadded to 4 x 8 patches, kept: 52 positions), 50 x 60 (2 x 2 tiles, unpadded to
6 x 8, shrunk to 4 x 6: 44 positions), 64 x 30 (2 x 1 tiles, 8 x 4 kept: 56 positions).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as T
from PIL import Image

from backends.mlx.cli.main import main
from backends.mlx.llm.decoder import llava_next, llava_onevision
from benchmarks.vision_checkpoints import build_llava_onevision, load_onevision_processor
from vision_helpers import one_image_chat, random_image, worst_gap

pytestmark = pytest.mark.slow

STEPS = 8
MAX_SEQ_LEN = 96
INT8_NATS = 0.2  # as tests/test_vision_language.py
SHAPES = {0: (40, 70), 1: (50, 60), 2: (64, 30)}  # (height, width) per image seed


def _image(seed: int) -> Image.Image:
    return random_image(seed, *SHAPES[seed])


def _export(directory, out, *extra):
    assert main(["export", "--model", str(directory), "--out", str(out), "--max-seq-len", str(MAX_SEQ_LEN),
                 *extra]) == 0
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = build_llava_onevision(tmp_path_factory.mktemp("onevision") / "ckpt")
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory)).eval()
    return directory, model, load_onevision_processor(directory)


@pytest.fixture(scope="module")
def program(checkpoint):
    """The float program (its export runs the check with an image)."""
    directory = checkpoint[0]
    return _export(directory, directory.parent / "f.pte")


def _generate(model, inputs) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0, inputs.input_ids.shape[1]:].tolist()


def _reference(model, processor, image):
    """The processor's inputs and transformers' greedy tokens for the chat with `image`."""
    text = processor.apply_chat_template(one_image_chat(), add_generation_prompt=True)
    inputs = processor(text=text, images=image, return_tensors="pt")
    return inputs, _generate(model, inputs)


def test_host_packing_equals_pack_image_features(checkpoint):
    """llava_onevision.pack == transformers' pack_image_features on random tile features, for sizes that keep,
    unpad, and shrink the grid picture (a picture of 6 x 8 patches and more is interpolated under anyres_max_2)."""
    directory, model, _ = checkpoint
    prompt = llava_onevision.image_prompt(model, None, 16)
    newline = model.model.image_newline.detach()
    shrunk = 0
    for height, width in [(40, 70), (50, 60), (64, 30), (64, 64), (20, 25), (70, 40)]:
        tiles = llava_onevision.tiles(prompt, height, width)
        features = torch.randn(tiles, 16, newline.shape[0], generator=torch.Generator().manual_seed(height))
        theirs, lens = model.model.pack_image_features([features], torch.tensor([[height, width]]), newline,
                                                       vision_aspect_ratio="anyres_max_2")
        ours = llava_onevision.pack(features, (height, width), prompt, newline)
        assert ours.shape == theirs[0].shape and int(lens[0]) == llava_onevision.feature_count(prompt, height, width)
        torch.testing.assert_close(ours, theirs[0], rtol=0, atol=1e-6)
        ys, xs = llava_next.kept(prompt, height, width)
        shrunk += ours.shape[0] < 16 + (ys.stop - ys.start) * (xs.stop - xs.start + 1)
    assert 0 < shrunk < 6  # some sizes interpolate, some do not
    one = torch.randn(1, 16, newline.shape[0])  # an image among several: its tile, then the newline
    theirs = model.model.pack_image_features([one], torch.tensor([[40, 70]]), newline)[0][0]
    torch.testing.assert_close(llava_onevision.pack(one, (40, 70), prompt, newline, images=2), theirs)


def test_greedy_tokens_equal_transformers(checkpoint, program):
    import etmlx
    from backends.mlx.llm.decoder.image_prompt import image_chat_prompt

    _, model, processor = checkpoint
    loaded = etmlx.load(program)
    counts, tokens = [], {}
    for seed in SHAPES:
        inputs, expected = _reference(model, processor, _image(seed))
        assert len(set(expected)) > 3, expected
        ids, _ = image_chat_prompt(loaded.tokenizer, loaded.meta, one_image_chat(_image(seed)))
        assert ids == inputs.input_ids[0].tolist()  # the processor's feature count for this image's size
        counts.append(ids.count(loaded.meta.image_token_id))
        tokens[seed] = [r.token for r in etmlx.stream_generate(loaded, one_image_chat(_image(seed)), STEPS)]
        assert tokens[seed] == expected, (seed, tokens[seed], expected)
    assert counts == [52, 44, 56] and len({tuple(t) for t in tokens.values()}) == 3  # the image decides
    raw = etmlx.stream_generate(loaded, "t5 t17 <image> t99 t3", STEPS, images=[_image(1)])
    assert [r.token for r in raw] == tokens[1]


def test_two_images_in_one_prompt_take_one_tile_each_as_transformers(checkpoint, program):
    """A chat's images reach transformers' processor as one list per conversation (apply_chat_template does so):
    batch_num_images [2], so neither is tiled; each takes one tile's positions and the newline."""
    import etmlx

    _, model, processor = checkpoint
    parts = [{"type": "text", "text": "t5"}, {"type": "image"}, {"type": "text", "text": "t17"}, {"type": "image"},
             {"type": "text", "text": "t99"}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    images = [_image(0), _image(1)]
    inputs = processor(text=text, images=[images], return_tensors="pt")
    assert inputs.batch_num_images.tolist() == [2] and inputs.pixel_values.shape[1] == 1
    expected = _generate(model, inputs)
    loaded = etmlx.load(program)
    got = [r.token for r in etmlx.stream_generate(loaded, [{"role": "user", "content": parts}], STEPS, images=images)]
    assert got == expected
    # the same image alone is tiled again (not the several-image encoding kept by content)
    alone = [r.token for r in etmlx.stream_generate(loaded, one_image_chat(_image(1)), STEPS)]
    assert alone == _reference(model, processor, _image(1))[1]


def test_int8_tokens_are_the_float_models_choices(checkpoint, tmp_path):
    import etmlx

    directory, model, processor = checkpoint
    loaded = etmlx.load(_export(directory, tmp_path / "q8.pte", "--quantize", "int8", "--no-verify"))
    for seed in (0, 1):
        text = processor.apply_chat_template(one_image_chat(), add_generation_prompt=True)
        inputs = processor(text=text, images=_image(seed), return_tensors="pt")
        tokens = [r.token for r in etmlx.stream_generate(loaded, one_image_chat(_image(seed)), STEPS)]
        ids = torch.cat([inputs.input_ids, torch.tensor([tokens])], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids[:, :-1], pixel_values=inputs.pixel_values,
                           image_sizes=inputs.image_sizes).logits[0, -STEPS:]
        worst = worst_gap(logits, tokens)
        print(f"llava_onevision int8, image {seed}: worst gap to the float model's best token {worst:.4f} nats")
        assert worst <= INT8_NATS, (worst, tokens)


def test_export_check_covers_the_packing(checkpoint, program):
    from backends.mlx.llm.decoder.verify import VerificationError
    from backends.mlx.llm.decoder.verify_vision import verify_with_image

    model = T.AutoModelForImageTextToText.from_pretrained(str(checkpoint[0])).eval()
    report = verify_with_image(model, program)  # the program agrees with its own checkpoint
    assert report.vision_error < 1e-4
    with torch.no_grad():  # control: a checkpoint whose image_newline differs (the vision method is unchanged)
        model.model.image_newline.mul_(-1)
    with pytest.raises(VerificationError, match="decodes differently from the eager model"):
        verify_with_image(model, program)


@pytest.mark.parametrize("key, value, message", [
    ("vision_aspect_ratio", "anyres", "llava_onevision: vision_aspect_ratio 'anyres' is not supported (only "
                                      "'anyres_max_N', N >= 1)"),
    ("vision_feature_select_strategy", "default", "llava_onevision: the vision method gives 15 features per tile, "
                                                  "the packing takes 4 x 4 (vision_feature_select_strategy "
                                                  "'default' with this vision tower)"),
])
def test_a_config_the_packing_cannot_follow_is_refused(checkpoint, tmp_path, capsys, key, value, message):
    directory = shutil.copytree(checkpoint[0], tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    assert main(["export", "--model", str(directory), "--out", str(tmp_path / "x.pte"), "--max-seq-len", "32",
                 "--no-verify"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"etmlx: error: {message}"
    assert not (tmp_path / "x.pte").exists()
