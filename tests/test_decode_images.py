"""Images in the C++ decode loop: `etmlx_decode FILE.pte --image PNG|JPEG` on a vision-language program decodes the
tokens the Python Decoder (whose tokens equal transformers' generate, tests/test_vision_language.py) decodes for the
same image and prompt, with no Python or torch in the process. Its preprocessing (tools/etmlx_decode/pixel_steps.cpp,
from the program's DecoderMeta.pixel_steps) makes llm/vision/preprocess.py's pixels bit for bit. Families it cannot
preprocess or place are refused by name, and bad input is a one-line error.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from backends.mlx.cli.main import main
from backends.mlx.llm.decoder.image_prompt import image_chat_prompt
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.vision.images import load_image
from backends.mlx.llm.vision.preprocess import preprocess
from backends.mlx.llm.decoder.image_encoder import processor_in
from backends.mlx.runtime.native_tools import tool_path
from benchmarks.vision_checkpoints import build_llava
from vision_helpers import one_image_chat, random_image

pytestmark = pytest.mark.slow

STEPS = 8
MAX_SEQ_LEN = 96


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    directory = build_llava(tmp_path_factory.mktemp("llava") / "ckpt")
    out = directory.parent / "f.pte"
    assert main(["export", "--model", str(directory), "--out", str(out), "--max-seq-len", str(MAX_SEQ_LEN)]) == 0
    return out, Decoder(out)


def _decode(pte, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool_path("etmlx_decode")), str(pte), *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _tokens(pte, ids, images, steps=STEPS) -> list[int]:
    flags = [x for f in images for x in ("--image", f)]
    run = _decode(pte, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", steps, "--json", *flags)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["tokens"]


def _saved(image, path):
    image.save(path)
    return path


def test_image_tokens_equal_the_python_decoders(llava, tmp_path):
    pte, decoder = llava
    got = {}
    for seed, size in ((0, (40, 48)), (1, (64, 30))):
        image = random_image(seed, *size)
        path = _saved(image, tmp_path / f"{seed}.png")
        ids, images = image_chat_prompt(decoder.tokenizer, decoder.meta, one_image_chat(image))
        expected = [s.token for s in decoder.stream(ids, STEPS, images=images, stop_at_eos=False)]
        got[seed] = _tokens(pte, ids, [path])
        assert got[seed] == expected, (seed, got[seed], expected)
        # one image token per image in the ids: expanded to the image's positions, as `etmlx generate` does
        mark = decoder.meta.image_token_id
        short = [t for i, t in enumerate(ids) if t != mark or ids[i - 1] != mark]
        assert len(short) < len(ids) and _tokens(pte, short, [path]) == expected
    assert got[0] != got[1]  # control: the image decides the tokens


def test_two_images_and_a_jpeg(llava, tmp_path):
    pte, decoder = llava
    first, second = random_image(3, 50, 60), random_image(4, 30, 30)
    jpeg = tmp_path / "b.jpg"
    second.save(jpeg, quality=90)
    second = load_image(jpeg)  # what the Python side decodes from the same file
    chat = [{"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": "t5"},
                                         {"type": "image", "image": second}, {"type": "text", "text": "t9"}]}]
    ids, images = image_chat_prompt(decoder.tokenizer, decoder.meta, chat)
    expected = [s.token for s in decoder.stream(ids, STEPS, images=images, stop_at_eos=False)]
    assert _tokens(pte, ids, [_saved(first, tmp_path / "a.png"), jpeg]) == expected
    swapped = _tokens(pte, ids, [jpeg, tmp_path / "a.png"])
    assert swapped != expected  # control: each image lands at its own positions


def test_dumped_pixels_equal_the_processors(llava, tmp_path):
    pte, _ = llava
    config = processor_in(pte)
    for seed, size in ((5, (40, 48)), (6, (20, 90)), (7, (33, 33))):
        path = _saved(random_image(seed, *size), tmp_path / f"{seed}.png")
        out = tmp_path / f"{seed}.bin"
        run = _decode(pte, "--image", path, "--dump-pixels", out)
        assert run.returncode == 0, run.stderr
        expected = preprocess([load_image(path)], config).pixel_values
        got = np.fromfile(out, dtype=np.float32).reshape(expected.shape)
        np.testing.assert_array_equal(got, expected)


def test_bad_image_input_is_one_line(llava, tmp_path):
    pte, decoder = llava
    image = random_image(8, 40, 48)
    ids, _ = image_chat_prompt(decoder.tokenizer, decoder.meta, one_image_chat(image))
    good = _saved(image, tmp_path / "good.png")
    broken = tmp_path / "broken.png"
    broken.write_bytes(good.read_bytes()[:200])
    text_only = [t for t in ids if t != decoder.meta.image_token_id]
    cases = {
        "broken": (ids, [broken]),
        "missing": (ids, [tmp_path / "nope.png"]),
        "two images, one mark": (ids, [good, good]),
        "a mark, no image": (ids, []),
        "an image, no mark": (text_only, [good]),
    }
    for name, (prompt, files) in cases.items():
        flags = [x for f in files for x in ("--image", f)]
        run = _decode(pte, "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", 2, *flags)
        # (the tiny checkpoint's word-level tokenizer adds a note line: pytorch_tokenizers cannot read it)
        lines = [line for line in run.stderr.strip().splitlines() if not line.startswith("etmlx_decode: note:")]
        assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("etmlx_decode: error:"), (name, run)



def _clip(**kw):
    return {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 32},
            "crop_size": {"height": 32, "width": 32}, **kw}


PIPELINES = {
    "clip": _clip(),
    "clip, crop past the resized image": _clip(size={"shortest_edge": 20}, crop_size={"height": 32, "width": 24}),
    "clip, no resize": _clip(do_resize=False, crop_size={"height": 16, "width": 40}),
    "clip, bilinear, fixed size": _clip(size={"height": 24, "width": 36}, resample=2),
    "llava, padded to a square": {"image_processor_type": "LlavaImageProcessor", "do_pad": True,
                                  "size": {"shortest_edge": 30}, "crop_size": {"height": 30, "width": 30}},
    "siglip": {"image_processor_type": "SiglipImageProcessor", "size": {"height": 24, "width": 40}},
    "gemma 3": {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 28, "width": 28},
                "image_seq_length": 4},
    "no rescale, no normalise": _clip(do_rescale=False, do_normalize=False),
}


def _cpp_pixels(image_path, steps, tmp_path) -> np.ndarray:
    """The pixels etmlx_image_read --meta makes from the file with `steps` (DecoderMeta.pixel_steps)."""
    from backends.mlx.llm.decoder.meta import DecoderMeta
    from backends.mlx.llm.sampler.config import SamplerConfig

    decoder = DecoderMeta.build(max_seq_len=8, vocab_size=8, batch=1, eos_token_ids=[], seeded=False,
                                config=SamplerConfig(), dtype="float32")
    decoder.pixel_steps = steps
    meta = tmp_path / "meta.bin"
    meta.write_bytes(decoder.to_bytes())
    run = subprocess.run([str(tool_path("etmlx_image_read")), str(image_path), "--meta", str(meta)],
                         capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr.decode()
    header, _, data = run.stdout.partition(b"\n")
    return np.frombuffer(data, dtype=np.float32).reshape([int(v) for v in header.split()])


def test_each_fixed_pipeline_makes_the_processors_pixels(tmp_path):
    from backends.mlx.llm.vision.preprocess import pixel_steps

    # (height, width): down, up, one axis, none, and the height shrinking most (Pillow then resizes it first)
    sizes = [(40, 48), (200, 300), (17, 90), (32, 32), (32, 90), (120, 40)]
    for index, size in enumerate(sizes):
        path = _saved(random_image(20 + index, *size), tmp_path / f"{index}.png")
        image = load_image(path)
        for name, config in PIPELINES.items():
            steps = pixel_steps(config)
            assert steps is not None, name
            expected = preprocess([image], config).pixel_values[0]
            np.testing.assert_array_equal(_cpp_pixels(path, steps, tmp_path), expected, err_msg=f"{name} {size}")
    # control: the other resampling filter gives other pixels
    steps = {**pixel_steps(PIPELINES["clip"]), "resample": 2}
    path = tmp_path / "1.png"
    assert not np.array_equal(_cpp_pixels(path, steps, tmp_path), preprocess([load_image(path)],
                                                                             PIPELINES["clip"]).pixel_values[0])


def test_pipelines_the_cpp_side_cannot_follow_have_no_steps():
    from backends.mlx.llm.vision.preprocess import pixel_steps

    assert pixel_steps({"image_processor_type": "Qwen2VLImageProcessor"}) is None  # patches
    assert pixel_steps({"image_processor_type": "Idefics3ImageProcessor"}) is None  # tiles
    assert pixel_steps(_clip(resample=1)) is None  # Lanczos: not implemented in C++
    assert pixel_steps({"image_processor_type": "NoSuchProcessor"}) is None
