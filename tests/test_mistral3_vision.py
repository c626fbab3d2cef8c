"""Mistral 3 programs (a Pixtral tower): a tiny random checkpoint with sharp weights
(benchmarks/mistral3_checkpoint.py), `etmlx export --model DIR`, then a chat with an image and text after it decodes
transformers' own greedy `generate` (the image processor's pixels and sizes, the prompt expanded as PixtralProcessor
does: rows of image tokens ended by [IMG_BREAK], the last by [IMG_END]), float and `--quantize int8`; an image of
another size is resized to the program's; the preprocessing equals transformers' PixtralImageProcessorPil; the export
check catches a wrong vision method.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image

from backends.mlx.cli.main import main
from backends.mlx.llm.decoder.image_prompt import image_chat_prompt
from backends.mlx.llm.vision.preprocess import preprocess
from benchmarks.mistral3_checkpoint import BREAK, END, IMAGE_SIDE, build_mistral3
from vision_helpers import worst_gap

pytestmark = pytest.mark.slow

STEPS = 10
MAX_SEQ_LEN = 64
INT8_NATS = 0.2  # as tests/test_model_families.py
SIDE = IMAGE_SIDE // 16  # merged tokens per row and rows: 8-pixel patches merged 2 x 2


def _image(seed: int, size=(IMAGE_SIDE, IMAGE_SIDE)) -> Image.Image:
    """size (height, width)."""
    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8"))


def _messages(image):
    return [{"role": "user", "content": [{"type": "text", "text": "t5 t17"}, {"type": "image", "image": image},
                                         {"type": "text", "text": "t99 t3 t40 t8"}]}]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    directory = build_mistral3(tmp_path_factory.mktemp("mistral3") / "ckpt")
    out = directory.parent / "f.pte"
    assert main(["export", "--model", str(directory), "--out", str(out), "--max-seq-len", str(MAX_SEQ_LEN)]) == 0
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory)).eval()
    return directory, out, model


def _inputs(directory, image, messages):
    """What transformers' PixtralProcessor returns (assembled from the image processor and tokenizer, as it does with
    patch size x merge): the image token replaced by rows of image tokens with their break and end tokens."""
    images = T.AutoImageProcessor.from_pretrained(str(directory))(images=[image], return_tensors="pt",
                                                                  patch_size={"height": 16, "width": 16})
    tokenizer = T.AutoTokenizer.from_pretrained(str(directory))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    height, width = images.image_sizes[0].tolist()
    rows = ["<image>" * (width // 16) + BREAK] * (height // 16)
    rows[-1] = rows[-1][:-len(BREAK)] + END
    ids = torch.tensor([tokenizer.encode(text.replace("<image>", "".join(rows)), add_special_tokens=False)])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=images.pixel_values,
                image_sizes=images.image_sizes)


def _generate(model, inputs):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_greedy_tokens_with_an_image_equal_transformers(mistral):
    import etmlx

    directory, pte, model = mistral
    program = etmlx.load(pte)
    tokens = {}
    for seed in (0, 1):
        image = _image(seed)
        inputs = _inputs(directory, image, _messages(image))
        assert inputs["image_sizes"].tolist() == [[IMAGE_SIDE, IMAGE_SIDE]]
        expected = _generate(model, inputs)
        assert len(set(expected)) > 3, expected
        ids, _ = image_chat_prompt(program.tokenizer, program.meta, _messages(image))
        assert ids == inputs["input_ids"][0].tolist()  # the image's rows, breaks and end as the processor writes
        assert ids.count(model.config.image_token_id) == SIDE * SIDE
        got = [r.token for r in etmlx.stream_generate(program, _messages(image), STEPS)]
        assert got == expected, (seed, got, expected)
        tokens[seed] = got
    assert tokens[0] != tokens[1]  # control: the image decides the tokens


def test_an_image_of_another_size_is_resized_to_the_programs(mistral):
    import etmlx

    directory, pte, model = mistral
    image = _image(2, (40, 150))  # the processor would give it another size (and number of tokens)
    assert _inputs(directory, image, _messages(image))["image_sizes"].tolist() != [[IMAGE_SIDE, IMAGE_SIDE]]
    resized = image.resize((IMAGE_SIDE, IMAGE_SIDE), Image.BICUBIC)
    expected = _generate(model, _inputs(directory, resized, _messages(resized)))
    assert [r.token for r in etmlx.stream_generate(etmlx.load(pte), _messages(image), STEPS)] == expected


def test_int8_tokens_are_the_float_models_choices(mistral, tmp_path):
    import etmlx

    directory, _, model = mistral
    pte = tmp_path / "q8.pte"
    assert main(["export", "--model", str(directory), "--out", str(pte), "--max-seq-len", str(MAX_SEQ_LEN),
                 "--quantize", "int8"]) == 0
    totals = []
    for seed in (0, 1):
        image = _image(seed)
        inputs = _inputs(directory, image, _messages(image))
        tokens = [r.token for r in etmlx.stream_generate(etmlx.load(pte), _messages(image), STEPS)]
        ids = torch.cat([inputs["input_ids"], torch.tensor([tokens])], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids[:, :-1], pixel_values=inputs["pixel_values"],
                           image_sizes=inputs["image_sizes"]).logits[0, -STEPS:]
        totals.append(worst_gap(logits, tokens))
    print(f"mistral3 int8: worst gap to the float model's best token {max(totals):.4f} nats")
    assert max(totals) <= INT8_NATS, totals


@pytest.mark.parametrize("size", [(64, 64), (50, 30), (100, 40), (13, 200)])
def test_preprocessing_equals_transformers(mistral, size):
    directory = mistral[0]
    image = _image(3, size)
    processor = T.AutoImageProcessor.from_pretrained(str(directory))
    want = processor(images=[image], return_tensors="np")
    got = preprocess([image], processor.to_dict())
    assert got.extras["image_sizes"].tolist() == want["image_sizes"].tolist()
    assert got.pixel_values.shape == want["pixel_values"].shape
    assert np.abs(got.pixel_values - want["pixel_values"]).max() == 0


def test_export_check_covers_the_vision_method(mistral):
    from backends.mlx.llm.decoder.verify import VerificationError
    from backends.mlx.llm.decoder.verify_vision import verify_with_image

    directory, pte, _ = mistral
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory), attn_implementation="eager").eval()
    assert verify_with_image(model, pte).vision_error < 1e-4  # control: the program against its own model
    with torch.no_grad():
        model.model.multi_modal_projector.patch_merger.merging_layer.weight.mul_(1.05)
    with pytest.raises(VerificationError, match="vision method differs from the eager vision forward"):
        verify_with_image(model, pte)
