"""LLaVA-NeXT ("anyres") programs: an image is its base tile plus the tiles of the grid pinpoint that fits it, each
encoded by the vision method, packed on the host (unpadded, image_newline after each row; llm/decoder/llava_next.py).
A tiny random checkpoint (benchmarks/vision_checkpoints.py) through `etmlx export --model`, then a chat with an image
decodes transformers' own greedy `generate` with its processor's inputs (float), or tokens the float model ranks
within INT8_NATS of its best (`--quantize int8`). Two images of different aspect ratios take different grids and
token counts (2 x 2 tiles, 52 positions; 2 x 1 tiles, 56 positions).
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from PIL import Image

from backends.mlx.cli.main import main
from benchmarks.vision_checkpoints import build_llava_next
from vision_helpers import one_image_chat, random_image, worst_gap

pytestmark = pytest.mark.slow

STEPS = 8
MAX_SEQ_LEN = 128  # two images in one prompt: 52 + 56 positions
INT8_NATS = 0.2  # as tests/test_vision_language.py
SHAPES = {0: (40, 70), 1: (64, 30)}  # (height, width) per image seed


def _image(seed: int) -> Image.Image:
    return random_image(seed, *SHAPES[seed])


def _export(directory, out, *extra):
    assert main(["export", "--model", str(directory), "--out", str(out), "--max-seq-len", str(MAX_SEQ_LEN),
                 *extra]) == 0
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = build_llava_next(tmp_path_factory.mktemp("anyres") / "ckpt")
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory)).eval()
    return directory, model, T.AutoProcessor.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def program(checkpoint):
    """The float program (its export runs the check with an image)."""
    directory = checkpoint[0]
    return _export(directory, directory.parent / "f.pte")


def _reference(model, processor, image):
    """The processor's inputs and transformers' greedy tokens for the chat with `image`."""
    text = processor.apply_chat_template(one_image_chat(), add_generation_prompt=True)
    inputs = processor(text=text, images=image, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return inputs, out[0, inputs.input_ids.shape[1]:].tolist()


def test_greedy_tokens_with_anyres_images_equal_transformers(checkpoint, program):
    import etmlx
    from backends.mlx.llm.decoder.image_prompt import image_chat_prompt

    _, model, processor = checkpoint
    loaded = etmlx.load(program)
    counts, tiles, tokens = set(), set(), {}
    for seed in SHAPES:
        inputs, expected = _reference(model, processor, _image(seed))
        assert len(set(expected)) > 3, expected
        tiles.add(inputs.pixel_values.shape[1])
        ids, _ = image_chat_prompt(loaded.tokenizer, loaded.meta, one_image_chat(_image(seed)))
        assert ids == inputs.input_ids[0].tolist()  # the processor's feature count for this image's size
        counts.add(ids.count(loaded.meta.image_token_id))
        tokens[seed] = [r.token for r in etmlx.stream_generate(loaded, one_image_chat(_image(seed)), STEPS)]
        assert tokens[seed] == expected, (seed, tokens[seed], expected)
    assert tiles == {5, 3} and counts == {52, 56} and tokens[0] != tokens[1]  # grids differ; the image decides
    # raw text names the image once with the image token; it expands to the image's positions as in the chat
    raw = etmlx.stream_generate(loaded, "t5 t17 <image> t99 t3", STEPS, images=[_image(1)])
    assert [r.token for r in raw] == tokens[1]


def test_two_images_of_different_grids_in_one_prompt_equal_transformers(checkpoint, program):
    import etmlx

    _, model, processor = checkpoint
    parts = [{"type": "text", "text": "t5"}, {"type": "image"}, {"type": "text", "text": "t17"}, {"type": "image"},
             {"type": "text", "text": "t99"}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    images = [_image(0), _image(1)]
    inputs = processor(text=text, images=images, return_tensors="pt")  # pixel_values padded to the larger grid
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    expected = out[0, inputs.input_ids.shape[1]:].tolist()
    got = etmlx.stream_generate(etmlx.load(program), [{"role": "user", "content": parts}], STEPS, images=images)
    assert [r.token for r in got] == expected


def test_int8_tokens_are_the_float_models_choices(checkpoint, tmp_path):
    import etmlx

    directory, model, processor = checkpoint
    loaded = etmlx.load(_export(directory, tmp_path / "q8.pte", "--quantize", "int8", "--no-verify"))
    for seed in SHAPES:
        inputs, _ = _reference(model, processor, _image(seed))
        tokens = [r.token for r in etmlx.stream_generate(loaded, one_image_chat(_image(seed)), STEPS)]
        ids = torch.cat([inputs.input_ids, torch.tensor([tokens])], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids[:, :-1], pixel_values=inputs.pixel_values,
                           image_sizes=inputs.image_sizes).logits[0, -STEPS:]
        worst = worst_gap(logits, tokens)
        print(f"llava_next int8, image {seed}: worst gap to the float model's best token {worst:.4f} nats")
        assert worst <= INT8_NATS, (worst, tokens)


def test_export_check_covers_the_vision_method_and_the_packing(checkpoint, program):
    from backends.mlx.llm.decoder.verify import VerificationError
    from backends.mlx.llm.decoder.verify_vision import verify_with_image

    directory = checkpoint[0]
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory)).eval()
    report = verify_with_image(model, program)  # the program agrees with its own checkpoint
    assert report.vision_error < 1e-4
    with torch.no_grad():  # control: a checkpoint whose image_newline differs (the vision method is unchanged)
        model.model.image_newline.mul_(-1)
    with pytest.raises(VerificationError, match="decodes differently from the eager model"):
        verify_with_image(model, program)
    with torch.no_grad():  # control: a checkpoint whose projector differs
        model.model.image_newline.mul_(-1)
        model.model.multi_modal_projector.linear_2.weight.mul_(1.05)
    with pytest.raises(VerificationError, match="vision method differs from the eager vision forward"):
        verify_with_image(model, program)


def test_a_feature_strategy_that_keeps_the_class_position_is_refused(checkpoint, tmp_path, capsys):
    import json
    import shutil

    directory = shutil.copytree(checkpoint[0], tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config["vision_feature_select_strategy"] = "full"
    (directory / "config.json").write_text(json.dumps(config))
    assert main(["export", "--model", str(directory), "--out", str(tmp_path / "x.pte"), "--max-seq-len", "32",
                 "--no-verify"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("etmlx: error: llava_next: vision_feature_select_strategy 'full' is not supported (only "
                       "'default': the class position dropped)")
    assert not (tmp_path / "x.pte").exists()


def test_the_cpp_decode_loop_refuses_anyres_images_by_name(program, tmp_path):
    import subprocess

    from backends.mlx.runtime.native_tools import tool_path

    _image(0).save(tmp_path / "a.png")
    run = subprocess.run([str(tool_path("etmlx_decode")), str(program), "--prompt-ids", "5,128,6", "--image",
                          str(tmp_path / "a.png")], capture_output=True, text=True, timeout=120)
    # (a note line says the word-level test tokenizer is not one pytorch_tokenizers reads)
    err = [line for line in run.stderr.strip().splitlines() if not line.startswith("etmlx_decode: note:")]
    assert run.returncode == 2 and len(err) == 1, run.stderr
    assert "does not give images to a llava_next program" in err[0] and "etmlx generate --image" in err[0]
