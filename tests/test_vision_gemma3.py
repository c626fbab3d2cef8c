"""Gemma 3 multimodal programs: a tiny random Gemma3ForConditionalGeneration with sharp weights and its processor
(benchmarks/gemma3_checkpoint.py), `etmlx export --model DIR`, then a chat with an image and text after it decodes
transformers' own greedy `generate` with the processor's inputs (float), or tokens the float model ranks within
INT8_NATS of its best (`--quantize int8`).

Gemma 3's image tokens see their whole image (image_blocks.py); the controls show that a plain causal mask gives
this checkpoint other logits and tokens, and that the export check tells the two masks apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image

from backends.mlx.cli.main import main
from backends.mlx.llm.decoder.image_prompt import image_chat_prompt
from benchmarks.gemma3_checkpoint import TOKENS_PER_IMAGE, build_gemma3
from vision_helpers import worst_gap

pytestmark = pytest.mark.slow

STEPS = 10
MAX_SEQ_LEN = 64
INT8_NATS = 0.2  # as tests/test_vision_language.py
SEEDS = (0, 5)  # images whose greedy tokens differ, and differ again under a causal mask
GENERATES_IMAGE_TOKEN = 1  # an image after which the model generates its own image token


def _image(seed: int, size=(40, 48)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8"))


def _messages(image=None, text="t99 t3"):
    part = {"type": "image", "image": image} if image is not None else {"type": "image"}
    return [{"role": "user", "content": [{"type": "text", "text": "t5 t17"}, part, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    directory = build_gemma3(tmp_path_factory.mktemp("gemma3") / "ckpt")
    out = directory.parent / "f.pte"
    # two rows: the server engine test prefills two prompts of different lengths (a padded row) in one call
    assert main(["export", "--model", str(directory), "--out", str(out), "--max-seq-len", str(MAX_SEQ_LEN),
                 "--batch", "2"]) == 0
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory), attn_implementation="eager").eval()
    return directory, out, model, T.AutoProcessor.from_pretrained(str(directory))


def _inputs(processor, image, messages=None):
    text = processor.apply_chat_template(messages or _messages(), add_generation_prompt=True)
    return processor(text=text, images=image, return_tensors="pt")


def _generate(model, inputs, bidirectional=True):
    """transformers' greedy tokens; bidirectional=False drops token_type_ids: a plain causal mask."""
    kwargs = dict(inputs) if bidirectional else {"input_ids": inputs.input_ids, "pixel_values": inputs.pixel_values}
    with torch.no_grad():
        out = model.generate(**kwargs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0, inputs.input_ids.shape[1]:].tolist()


def test_greedy_tokens_with_an_image_equal_transformers(gemma3):
    import etmlx

    directory, pte, model, processor = gemma3
    program = etmlx.load(pte)
    tokens = {}
    for seed in SEEDS:
        image = _image(seed)
        inputs = _inputs(processor, image)
        expected = _generate(model, inputs)
        assert len(set(expected)) > 3, expected
        assert _generate(model, inputs, bidirectional=False) != expected  # control: the image block matters here
        ids, _ = image_chat_prompt(program.tokenizer, program.meta, _messages(image))
        assert ids == inputs.input_ids[0].tolist()  # boi, the image's positions, eoi, as the processor writes them
        assert ids.count(program.meta.image_token_id) == TOKENS_PER_IMAGE and ids[-1] != program.meta.image_token_id
        got = [r.token for r in etmlx.stream_generate(program, _messages(image), STEPS)]
        assert got == expected, (seed, got, expected)
        tokens[seed] = got
    assert tokens[SEEDS[0]] != tokens[SEEDS[1]]  # control: the image decides the tokens


def test_a_generated_image_token_embeds_as_text(gemma3):
    """With this image the model generates its own image token: as in transformers (whose decode steps carry no
    pixels) that position embeds the token as text, not as a zero image vector (image_blocks.image_positions)."""
    import etmlx

    directory, pte, model, processor = gemma3
    image = _image(GENERATES_IMAGE_TOKEN)
    expected = _generate(model, _inputs(processor, image))
    assert model.config.image_token_id in expected, expected  # control: the case this test is about happens
    got = [r.token for r in etmlx.stream_generate(etmlx.load(pte), _messages(image), STEPS)]
    assert got == expected


def test_the_image_block_mask_gives_transformers_logits_and_causal_does_not(gemma3, monkeypatch):
    from backends.mlx.llm.decoder import kv_cache
    from backends.mlx.llm.decoder.kv_cache import StaticCacheLM

    _, _, model, processor = gemma3
    inputs = _inputs(processor, _image(SEEDS[0]))
    ids = inputs.input_ids
    with torch.no_grad():
        embeds = model.model.get_image_features(pixel_values=inputs.pixel_values).pooler_output
        want = model(**inputs).logits[0]
        causal = model(input_ids=ids, pixel_values=inputs.pixel_values).logits[0]
        image_embeds = torch.zeros(1, ids.shape[1], embeds.shape[-1])
        image_embeds[0, ids[0] == model.config.image_token_id] = embeds[0]

        def run():
            lm = StaticCacheLM(model, MAX_SEQ_LEN)
            return lm(ids, torch.zeros(1, dtype=torch.int64), image_embeds=image_embeds)[0]

        got = run()
        monkeypatch.setattr(kv_cache, "bidirectional_images", lambda config: False)
        plain = run()
    after = slice(int((ids[0] == model.config.image_token_id).nonzero()[0]), None)  # from the first image token
    assert (got - want).abs().max() < 1e-4
    assert (plain - causal).abs().max() < 1e-4
    gap = (plain[after] - want[after]).abs().max()
    assert gap > 0.01, gap  # control: a causal mask changes this checkpoint's logits after the image


def test_int8_tokens_are_the_float_models_choices(gemma3, tmp_path):
    import etmlx

    directory, _, model, processor = gemma3
    pte = tmp_path / "q8.pte"
    assert main(["export", "--model", str(directory), "--out", str(pte), "--max-seq-len", str(MAX_SEQ_LEN),
                 "--quantize", "int8"]) == 0
    program = etmlx.load(pte)
    for seed in SEEDS:
        image = _image(seed)
        inputs = _inputs(processor, image)
        tokens = [r.token for r in etmlx.stream_generate(program, _messages(image), STEPS)]
        ids = torch.cat([inputs.input_ids, torch.tensor([tokens])], dim=1)
        types = torch.cat([inputs.token_type_ids, torch.zeros(1, STEPS, dtype=torch.int64)], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids[:, :-1], pixel_values=inputs.pixel_values,
                           token_type_ids=types[:, :-1]).logits[0, -STEPS:]
        worst = worst_gap(logits, tokens)
        print(f"gemma3 int8 image {seed}: worst gap to the float model's best token {worst:.4f} nats")
        assert worst <= INT8_NATS, (seed, worst, tokens)


def test_the_export_check_tells_the_image_block_from_a_causal_mask(gemma3, monkeypatch):
    from backends.mlx.llm.decoder import verify_vision
    from backends.mlx.llm.decoder.verify import VerificationError

    _, pte, model, _ = gemma3
    report = verify_vision.verify_with_image(model, pte)
    assert report.steps > 0 and report.vision_error < 1e-4
    # control: against a causal reference the same program decodes differently, so the check sees the mask
    monkeypatch.setattr(verify_vision, "bidirectional_images", lambda config: False)
    with pytest.raises(VerificationError, match="decodes differently from the eager model"):
        verify_vision.verify_with_image(model, pte)


def test_generate_image_flag_and_bad_marks(gemma3, tmp_path, capsys):
    import json

    import etmlx

    directory, pte, model, processor = gemma3
    _image(SEEDS[1]).save(tmp_path / "a.png")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t99 t3"}]}]
    expected = _generate(model, _inputs(processor, _image(SEEDS[1]), messages))
    capsys.readouterr()
    assert main(["generate", str(pte), "-p", "t99 t3", "--image", str(tmp_path / "a.png"), "-m", str(STEPS),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == expected
    with pytest.raises(ValueError, match="the prompt has 2 image mark\\(s\\) '<start_of_image>' for 1 image"):
        etmlx.generate(etmlx.load(pte), _messages(_image(0), text="t3 <start_of_image>"), 2)


def test_the_server_engine_prefills_two_images_in_one_call(gemma3):
    from backends.mlx.llm.decoder.meta import DecoderMeta
    from backends.mlx.llm.sampler.params import SamplingParams
    from backends.mlx.runtime.runner import load_method
    from backends.mlx.serve.engine import Engine, EngineRequest

    _, pte, model, processor = gemma3
    engine = Engine(load_method(pte), DecoderMeta.load(pte), pte=pte)
    engine.running = True  # driven by hand, one loop turn at a time (as tests/test_serve_engine.py)
    requests = []
    for seed, text in zip(SEEDS, ("t5 t17", "t5 t17 t40 t41 t42")):  # the shorter row is padded in the prefill
        messages = [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"},
                                                 {"type": "text", "text": "t99 t3"}]}]
        inputs = _inputs(processor, _image(seed), messages)
        events = []
        engine.submit(EngineRequest(inputs.input_ids[0].tolist(), SamplingParams(), STEPS, events.append,
                                    stop_at_eos=False, images=[_image(seed)]))
        requests.append((events, _generate(model, inputs)))
    engine._drain()
    engine._admit()
    assert engine.active_rows == 2  # both prefill in the next call
    for _ in range(4 * STEPS):
        if all(events and events[-1].finish_reason for events, _ in requests):
            break
        engine._drain()
        engine._admit()
        if engine.active_rows:
            engine._step()
    for events, expected in requests:
        assert [e.token for e in events] == expected


def test_the_cpp_decode_loop_decodes_the_same_tokens(gemma3, tmp_path):
    """`etmlx_decode --image` on Gemma 3 (its image text: start and end tokens around the image's positions; its
    fixed-size bilinear processor) gives the Python Decoder's tokens, in a batch-2 program's first row."""
    import json
    import subprocess

    from backends.mlx.llm.decoder.loop import Decoder
    from backends.mlx.runtime.native_tools import tool_path

    _, pte, _, _ = gemma3
    decoder = Decoder(pte)
    for seed in SEEDS:
        _image(seed).save(tmp_path / f"{seed}.png")
        ids, images = image_chat_prompt(decoder.tokenizer, decoder.meta, _messages(_image(seed)))
        expected = [s.token for s in decoder.stream(ids, STEPS, images=images, stop_at_eos=False)]
        run = subprocess.run([str(tool_path("etmlx_decode")), str(pte), "--prompt-ids", ",".join(map(str, ids)),
                              "--image", str(tmp_path / f"{seed}.png"), "--max-tokens", str(STEPS), "--json"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["tokens"] == expected, seed
