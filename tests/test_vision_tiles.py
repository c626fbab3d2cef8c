"""Idefics3 / SmolVLM programs, whose images are cut into tiles: tiny random checkpoints (benchmarks/
idefics3_checkpoints.py) through `etmlx export --model DIR`, then a chat with an image decodes transformers' own
greedy `generate` with its processor's inputs (float), or tokens the float model ranks within INT8_NATS of its best
(`--quantize int8`). Two images of different aspect ratios take different tile counts (2 x 2 + the whole image,
2 x 1 + the whole image); a processor without image splitting takes the whole image alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image

from backends.mlx.cli.main import main
from benchmarks.idefics3_checkpoints import build_idefics3, reference_processor
from vision_helpers import worst_gap

pytestmark = pytest.mark.slow

STEPS = 8
MAX_SEQ_LEN = 64
INT8_NATS = 0.2  # as tests/test_vision_language.py
SHAPES = {0: (40, 70), 1: (64, 30)}  # (height, width) per image seed: 5 and 3 tiles
SEEDS = {"idefics3": 7, "smolvlm": 11}


def _image(seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(*SHAPES[seed], 3) * 255).astype("uint8"))


def _messages(image):
    return [{"role": "user", "content": [{"type": "text", "text": "t5 t17"}, {"type": "image", "image": image},
                                         {"type": "text", "text": "t99 t3"}]}]


def _export(directory, out, *extra):
    assert main(["export", "--model", str(directory), "--out", str(out), "--max-seq-len", str(MAX_SEQ_LEN),
                 *extra]) == 0
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiles")
    return {family: build_idefics3(root / family, family, seed=seed) for family, seed in SEEDS.items()}


@pytest.fixture(scope="module")
def references(checkpoints):
    """family -> (model, processor)."""
    return {family: (T.AutoModelForImageTextToText.from_pretrained(str(d)).eval(), reference_processor(d))
            for family, d in checkpoints.items()}


def _reference(model, processor, image):
    """The processor's inputs and transformers' greedy tokens for the chat with `image`."""
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "t5 t17"}, {"type": "image"}, {"type": "text", "text": "t99 t3"}]}],
        add_generation_prompt=True)
    inputs = processor(text=text, images=image, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return inputs, out[0, inputs.input_ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def floats(checkpoints, tmp_path_factory):
    """family -> float program (each export runs its own check with an image)."""
    root = tmp_path_factory.mktemp("programs")
    return {family: _export(d, root / f"{family}.pte") for family, d in checkpoints.items()}


@pytest.mark.parametrize("family", list(SEEDS))
def test_greedy_tokens_with_tiled_images_equal_transformers(family, floats, references):
    import etmlx
    from backends.mlx.llm.decoder.image_prompt import image_chat_prompt

    program = etmlx.load(floats[family])
    model, processor = references[family]
    tiles, tokens = set(), {}
    for seed in SHAPES:
        inputs, expected = _reference(model, processor, _image(seed))
        assert len(set(expected)) > 3, expected
        tiles.add(inputs.pixel_values.shape[1])
        ids, _ = image_chat_prompt(program.tokenizer, program.meta, _messages(_image(seed)))
        assert ids == inputs.input_ids[0].tolist()  # tiles, markers and newlines where the processor puts them
        tokens[seed] = [r.token for r in etmlx.stream_generate(program, _messages(_image(seed)), STEPS)]
        assert tokens[seed] == expected, (seed, tokens[seed], expected)
    assert tiles == {5, 3} and tokens[0] != tokens[1]  # the tile count differs; the image decides the tokens
    # raw text names the image once with the image token; it expands to the image's tiles as in the chat
    raw = etmlx.stream_generate(program, "t5 t17 <image> t99 t3", STEPS, images=[_image(1)])
    assert [r.token for r in raw] == tokens[1]


def test_int8_tokens_are_the_float_models_choices(checkpoints, references, tmp_path):
    import etmlx

    family = "smolvlm"  # the same modules as Idefics3's (one int8 export keeps the suite's time down)

    program = etmlx.load(_export(checkpoints[family], tmp_path / "q8.pte", "--quantize", "int8", "--no-verify"))
    model, processor = references[family]
    for seed in SHAPES:
        inputs, _ = _reference(model, processor, _image(seed))
        tokens = [r.token for r in etmlx.stream_generate(program, _messages(_image(seed)), STEPS)]
        ids = torch.cat([inputs.input_ids, torch.tensor([tokens])], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids[:, :-1], pixel_values=inputs.pixel_values,
                           pixel_attention_mask=inputs.pixel_attention_mask).logits[0, -STEPS:]
        worst = worst_gap(logits, tokens)
        print(f"{family} int8, image {seed}: worst gap to the float model's best token {worst:.4f} nats")
        assert worst <= INT8_NATS, (worst, tokens)


def test_without_image_splitting_an_image_is_one_tile(tmp_path):
    import etmlx

    directory = build_idefics3(tmp_path / "whole", "idefics3", splitting=False, seed=5)
    program = etmlx.load(_export(directory, tmp_path / "w.pte", "--no-verify"))
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory)).eval()
    processor = reference_processor(directory)
    for seed in SHAPES:
        inputs, expected = _reference(model, processor, _image(seed))
        assert inputs.pixel_values.shape[1] == 1
        assert [r.token for r in etmlx.stream_generate(program, _messages(_image(seed)), STEPS)] == expected


def test_export_check_covers_the_tile_vision_method(checkpoints, floats):
    from backends.mlx.llm.decoder.verify import VerificationError
    from backends.mlx.llm.decoder.verify_vision import verify_with_image

    pte = floats["idefics3"]
    model = T.AutoModelForImageTextToText.from_pretrained(str(checkpoints["idefics3"])).eval()
    report = verify_with_image(model, pte)  # the program agrees with its own checkpoint
    assert report.vision_error < 1e-4
    with torch.no_grad():  # control: the same program against a checkpoint whose connector differs
        model.model.connector.modality_projection.proj.weight.mul_(1.05)
    with pytest.raises(VerificationError, match="vision method differs from the eager vision forward"):
        verify_with_image(model, pte)


def test_tiles_of_another_size_than_the_tower_are_refused(checkpoints, tmp_path, capsys):
    import json
    import shutil

    directory = shutil.copytree(checkpoints["smolvlm"], tmp_path / "m")
    config = json.loads((directory / "preprocessor_config.json").read_text())
    config["max_image_size"] = {"longest_edge": 16}
    (directory / "preprocessor_config.json").write_text(json.dumps(config))
    assert main(["export", "--model", str(directory), "--out", str(tmp_path / "x.pte"), "--max-seq-len", "32",
                 "--no-verify"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "etmlx: error: the image processor's tiles are 16 pixels, the vision tower takes 32: not supported"
    assert not (tmp_path / "x.pte").exists()
