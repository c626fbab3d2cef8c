"""Qwen2-VL and Qwen2.5-VL programs (each test on both; Qwen2.5-VL's tower has window attention): a tiny random
checkpoint with sharp weights (benchmarks/qwen2_vl_checkpoint.py), `etmlx export --model DIR`, then a chat with an
image and text after it decodes transformers' own greedy `generate` (the image processor's patches and grid, the
prompt expanded and typed as transformers' processor does: M-RoPE positions from transformers' get_rope_index),
float and `--quantize int8`; the host's M-RoPE positions equal get_rope_index's with two images; the export check
catches a wrong vision method and 1-D positions in place of M-RoPE's; Qwen2.5-VL's vision method equals
transformers' tower, and does not without its windows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image

from backends.mlx.cli.main import main
from backends.mlx.llm.decoder.image_encoder import PromptImages
from backends.mlx.llm.decoder.image_prompt import image_chat_prompt
from backends.mlx.llm.decoder.qwen2_vl import rope_positions
from benchmarks.qwen2_vl_checkpoint import IMAGE_SIDE, build_qwen2_vl
from vision_helpers import worst_gap

pytestmark = pytest.mark.slow

STEPS = 10
MAX_SEQ_LEN = 64
INT8_NATS = 0.2  # as tests/test_model_families.py
TOKENS = (IMAGE_SIDE // 28) ** 2  # image tokens: the merged grid of a program image


def _image(seed: int, size=(80, 90)) -> Image.Image:
    """size (height, width): 80 x 90 and 90 x 84 round to the program's 84 x 84 in transformers' processor."""
    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8"))


def _messages(image):
    return [{"role": "user", "content": [{"type": "text", "text": "t5 t17"}, {"type": "image", "image": image},
                                         {"type": "text", "text": "t99 t3 t40 t8"}]}]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(tmp_path_factory, request):
    directory = build_qwen2_vl(tmp_path_factory.mktemp(request.param) / "ckpt", family=request.param)
    out = directory.parent / "f.pte"
    assert main(["export", "--model", str(directory), "--out", str(out), "--max-seq-len", str(MAX_SEQ_LEN)]) == 0
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory)).eval()
    return directory, out, model


def _inputs(directory, image, messages):
    """What transformers' Qwen2VLProcessor returns (it needs torchvision for its video half, so it is assembled from
    its image processor and tokenizer as it does): the image token expanded to the grid's merged positions, typed."""
    images = T.AutoImageProcessor.from_pretrained(str(directory))(images=[image], return_tensors="pt")
    tokenizer = T.AutoTokenizer.from_pretrained(str(directory))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens = int(images.image_grid_thw[0].prod()) // 4
    ids = torch.tensor([tokenizer.encode(text.replace("<image>", "<image>" * tokens), add_special_tokens=False)])
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=images.pixel_values,
                image_grid_thw=images.image_grid_thw, mm_token_type_ids=(ids == image_id).int())


def _generate(model, inputs):
    model.model.rope_deltas = None
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_greedy_tokens_with_an_image_equal_transformers(qwen):
    import etmlx

    directory, pte, model = qwen
    program = etmlx.load(pte)
    tokens = {}
    for seed, size in ((0, (80, 90)), (1, (90, 84))):
        image = _image(seed, size)
        inputs = _inputs(directory, image, _messages(image))
        assert inputs["image_grid_thw"].tolist() == [[1, IMAGE_SIDE // 14, IMAGE_SIDE // 14]]
        expected = _generate(model, inputs)
        assert len(set(expected)) > 3, expected
        ids, _ = image_chat_prompt(program.tokenizer, program.meta, _messages(image))
        assert ids == inputs["input_ids"][0].tolist()  # the image expanded to the processor's positions
        got = [r.token for r in etmlx.stream_generate(program, _messages(image), STEPS)]
        assert got == expected, (seed, got, expected)
        tokens[seed] = got
    assert tokens[0] != tokens[1]  # control: the image decides the tokens


def test_an_image_of_another_size_is_resized_to_the_programs(qwen):
    import etmlx

    directory, pte, model = qwen
    image = _image(2, (40, 150))  # the processor would give it another grid (and number of tokens)
    assert T.AutoImageProcessor.from_pretrained(str(directory))(images=[image]).image_grid_thw.tolist() != [
        [1, IMAGE_SIDE // 14, IMAGE_SIDE // 14]]
    resized = image.resize((IMAGE_SIDE, IMAGE_SIDE), Image.BICUBIC)
    expected = _generate(model, _inputs(directory, resized, _messages(resized)))
    assert [r.token for r in etmlx.stream_generate(etmlx.load(pte), _messages(image), STEPS)] == expected


def test_int8_tokens_are_the_float_models_choices(qwen, tmp_path):
    import etmlx

    directory, _, model = qwen
    pte = tmp_path / "q8.pte"
    assert main(["export", "--model", str(directory), "--out", str(pte), "--max-seq-len", str(MAX_SEQ_LEN),
                 "--quantize", "int8"]) == 0
    totals = []
    for seed in (0, 1):
        image = _image(seed)
        inputs = _inputs(directory, image, _messages(image))
        tokens = [r.token for r in etmlx.stream_generate(etmlx.load(pte), _messages(image), STEPS)]
        ids = torch.cat([inputs["input_ids"], torch.tensor([tokens])], dim=1)
        model.model.rope_deltas = None
        with torch.no_grad():
            logits = model(input_ids=ids[:, :-1], pixel_values=inputs["pixel_values"],
                           image_grid_thw=inputs["image_grid_thw"],
                           mm_token_type_ids=(ids[:, :-1] == model.config.image_token_id).int()).logits[0, -STEPS:]
        totals.append(worst_gap(logits, tokens))
    print(f"{model.config.model_type} int8: worst gap to the float model's best token {max(totals):.4f} nats")
    assert max(totals) <= INT8_NATS, totals


def test_rope_positions_equal_transformers_get_rope_index(qwen):
    """Two images, text between and after them; every window of positions (prefill chunks, decode steps)."""
    _, _, model = qwen
    image = model.config.image_token_id
    ids = [3, 4] + [image] * TOKENS + [5, 6, 7] + [image] * TOKENS + [8, 9]
    positions, deltas = model.model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=torch.tensor([[int(t == image) for t in ids]]),
        image_grid_thw=torch.tensor([[1, IMAGE_SIDE // 14, IMAGE_SIDE // 14]] * 2))
    want = positions[:, 0].T  # [L, 3]
    images = PromptImages(torch.tensor([i for i, t in enumerate(ids) if t == image]), torch.zeros(2 * TOKENS, 1))
    assert torch.equal(rope_positions(images, TOKENS, 0, len(ids)), want)
    for start in range(len(ids)):  # any chunk, alone
        assert torch.equal(rope_positions(images, TOKENS, start, 3)[:len(ids) - start], want[start:start + 3])
    after = rope_positions(images, TOKENS, len(ids) + 4, 1)  # a decode step: position + the row's delta
    assert after.tolist() == [[len(ids) + 4 + int(deltas)] * 3] and int(deltas) < 0
    assert rope_positions(None, TOKENS, 7, 2).tolist() == [[7] * 3, [8] * 3]


def test_export_check_covers_the_vision_method_and_mrope(qwen, monkeypatch):
    from backends.mlx.llm.decoder import decode_rows, qwen2_vl
    from backends.mlx.llm.decoder.verify import VerificationError
    from backends.mlx.llm.decoder.verify_vision import verify_with_image

    directory, pte, _ = qwen
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory), attn_implementation="eager").eval()
    assert verify_with_image(model, pte).vision_error < 1e-4  # control: the program against its own model
    with monkeypatch.context() as patch:  # 1-D positions in place of M-RoPE's
        patch.setattr(decode_rows, "rope_positions", lambda _images, _tokens, start, length:
                      qwen2_vl.plain_positions(start, length))
        with pytest.raises(VerificationError, match="decodes differently from the eager model"):
            verify_with_image(model, pte)
    with torch.no_grad():
        model.model.visual.merger.mlp[2].weight.mul_(1.05)
    with pytest.raises(VerificationError, match="vision method differs from the eager vision forward"):
        verify_with_image(model, pte)


def test_a_second_question_reuses_the_image_and_its_positions(qwen):
    """The prompt cache's prefix (the image prefilled at its M-RoPE positions) and a longer question after it: the
    tokens transformers gives the whole prompt."""
    from backends.mlx.llm.decoder.loop import Decoder

    directory, pte, model = qwen
    decoder = Decoder(pte)
    image = _image(0)
    ids, images = image_chat_prompt(decoder.tokenizer, decoder.meta, _messages(image))
    first = [s.token for s in decoder.stream(ids, STEPS, images=images, reuse=True)]
    longer = [*_messages(image)[0]["content"], {"type": "text", "text": "t60 t61"}]
    more = [{"role": "user", "content": longer}]
    ids2, _ = image_chat_prompt(decoder.tokenizer, decoder.meta, more)
    again = [s.token for s in decoder.stream(ids2, STEPS, images=[image.copy()], reuse=True)]
    assert decoder.last_cached > 2 + TOKENS and decoder.images.encoded == 1  # past the image: neither encoded again
    assert first == _generate(model, _inputs(directory, image, _messages(image)))
    assert again == _generate(model, _inputs(directory, image, more))


def test_qwen2_5_vl_windows_are_transformers(tmp_path):
    """The vision method's window order, masks and inverse order against transformers' tower on random pixels; the
    control: every block attending to the whole image (Qwen2-VL's way) differs."""
    from backends.mlx.llm.decoder.qwen2_vl import Qwen2VLVision

    directory = build_qwen2_vl(tmp_path / "ckpt", family="qwen2_5_vl")
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory)).eval()
    grid = [1, IMAGE_SIDE // 14, IMAGE_SIDE // 14]
    encoder = Qwen2VLVision(model, grid).eval()
    assert encoder.windowed == [True, False, True]
    assert sorted(encoder.windows.sum(1).unique().tolist()) == [4, 8, 16]  # windows of 1, 2 and 4 merged tokens
    pixels = torch.randn(1, *encoder.pixel_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = encoder.reference(pixels)
        assert (encoder(pixels) - expected).abs().max() < 1e-4
        encoder.windowed = [False] * 3
        assert (encoder(pixels) - expected).abs().max() > 0.1


def test_the_cpp_decode_loop_decodes_text_and_refuses_images_by_name(qwen, tmp_path):
    """etmlx_decode fills the program's rope_positions with text positions: a text prompt decodes the Python
    Decoder's tokens; an image is refused by name (its patches and multimodal positions are the Python side's)."""
    import json
    import subprocess

    from backends.mlx.llm.decoder.loop import Decoder
    from backends.mlx.runtime.native_tools import tool_path

    pte = qwen[1]
    ids = [5, 17, 99, 3, 42, 7]
    expected = [s.token for s in Decoder(pte).stream(ids, STEPS, stop_at_eos=False)]
    run = subprocess.run([str(tool_path("etmlx_decode")), str(pte), "--prompt-ids", ",".join(map(str, ids)),
                          "--max-tokens", str(STEPS), "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["tokens"] == expected
    _image(0).save(tmp_path / "a.png")
    run = subprocess.run([str(tool_path("etmlx_decode")), str(pte), "--prompt-ids", "5,17", "--image",
                          str(tmp_path / "a.png")], capture_output=True, text=True, timeout=120)
    err = [line for line in run.stderr.strip().splitlines() if not line.startswith("etmlx_decode: note:")]
    assert run.returncode == 2 and len(err) == 1 and "does not give images to a qwen2" in err[0], run.stderr
