"""Vision-language programs as a user meets them: a tiny random LLaVA checkpoint with sharp weights and its
processor, `etmlx export --model DIR`, then a chat with an image decodes transformers' own greedy `generate` with
the processor's inputs for the same image (float), or tokens the float model ranks within INT8_NATS of its best
(`--quantize int8`). Other vision-language families are refused by name; a text-only program refuses images.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image

from backends.mlx.cli.main import main
from backends.mlx.llm.decoder import vision_export
from backends.mlx.llm.decoder.image_prompt import image_chat_prompt
from backends.mlx.runtime.native_tools import tool_path
from benchmarks.vision_checkpoints import build_llava
from vision_helpers import worst_gap

pytestmark = pytest.mark.slow

STEPS = 10
MAX_SEQ_LEN = 64
INT8_NATS = 0.2  # as tests/test_model_families.py


def _image(seed: int, size=(40, 48)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8"))


def _messages(image=None):
    part = {"type": "image", "image": image} if image is not None else {"type": "image"}
    return [{"role": "user", "content": [{"type": "text", "text": "t5 t17"}, part, {"type": "text", "text": "t99 t3"}]}]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    directory = build_llava(tmp_path_factory.mktemp("llava") / "ckpt")
    out = directory.parent / "f.pte"
    assert main(["export", "--model", str(directory), "--out", str(out), "--max-seq-len", str(MAX_SEQ_LEN)]) == 0
    return directory, out


def _reference(directory, image, messages=None):
    """transformers' processor inputs and greedy tokens for the chat with `image` (default: _messages())."""
    processor = T.AutoProcessor.from_pretrained(str(directory))
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory)).eval()
    text = processor.apply_chat_template(messages or _messages(), add_generation_prompt=True)
    inputs = processor(text=text, images=image, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return model, inputs, out[0, inputs.input_ids.shape[1]:].tolist()


def test_greedy_tokens_with_an_image_equal_transformers(llava):
    import etmlx

    directory, pte = llava
    program = etmlx.load(pte)
    tokens = {}
    for seed in (0, 1):
        image = _image(seed)
        _, inputs, expected = _reference(directory, image)
        assert len(set(expected)) > 3, expected
        ids, _ = image_chat_prompt(program.tokenizer, program.meta, _messages(image))
        assert ids == inputs.input_ids[0].tolist()  # the image expanded to the processor's positions
        got = [r.token for r in etmlx.stream_generate(program, _messages(image), STEPS)]
        assert got == expected, (seed, got, expected)
        tokens[seed] = got
    assert tokens[0] != tokens[1]  # control: the image decides the tokens


def test_generate_image_flag_decodes_transformers_tokens(llava, tmp_path, capsys):
    import json

    directory, pte = llava
    _image(0).save(tmp_path / "a.png")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t99 t3"}]}]
    _, _, expected = _reference(directory, _image(0), messages)
    capsys.readouterr()
    assert main(["generate", str(pte), "-p", "t99 t3", "--image", str(tmp_path / "a.png"), "-m", str(STEPS),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == expected


def test_bad_images_are_one_line_errors(llava, tmp_path, capsys):
    import etmlx

    _, pte = llava
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    rc = main(["generate", str(pte), "-p", "t1", "--image", str(tmp_path / "bad.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith(f"etmlx: error: --image {tmp_path / 'bad.png'}: "), err
    program = etmlx.load(pte)
    with pytest.raises(ValueError, match="image part without an image"):
        etmlx.generate(program, _messages(), 2)
    with pytest.raises(ValueError, match="1 image\\(s\\) given beyond the messages' image parts"):
        etmlx.generate(program, _messages(_image(0)), 2, images=[_image(1)])
    with pytest.raises(ValueError, match="the prompt has 0 image token\\(s\\) for 1 image"):
        etmlx.generate(program, "t1 t2", 2, images=[_image(1)])


def test_int8_tokens_are_the_float_models_choices(llava, tmp_path):
    import etmlx

    directory, _ = llava
    pte = tmp_path / "q8.pte"
    assert main(["export", "--model", str(directory), "--out", str(pte), "--max-seq-len", str(MAX_SEQ_LEN),
                 "--quantize", "int8"]) == 0
    image = _image(0)
    model, inputs, _ = _reference(directory, image)
    tokens = [r.token for r in etmlx.stream_generate(etmlx.load(pte), _messages(image), STEPS)]
    ids = torch.cat([inputs.input_ids, torch.tensor([tokens])], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1], pixel_values=inputs.pixel_values).logits[0, -STEPS:]
    worst = worst_gap(logits, tokens)
    print(f"llava int8: worst gap to the float model's best token {worst:.4f} nats")
    assert worst <= INT8_NATS, (worst, tokens)


def test_a_second_question_about_the_same_image_reuses_it(llava):
    from backends.mlx.llm.decoder.loop import Decoder

    _, pte = llava
    decoder = Decoder(pte)
    image = _image(0)
    ids, images = image_chat_prompt(decoder.tokenizer, decoder.meta, _messages(image))
    first = [s.token for s in decoder.stream(ids, STEPS, images=images, reuse=True)]
    again = [s.token for s in decoder.stream(ids, STEPS, images=[image.copy()], reuse=True)]
    assert again == first
    assert decoder.last_cached == len(ids) - 1 and decoder.images.encoded == 1  # neither prefilled nor encoded
    other = [s.token for s in decoder.stream(ids, STEPS, images=[_image(1)], reuse=True)]
    assert decoder.last_cached == 2 and decoder.images.encoded == 2  # only the text before the image is shared
    assert other != first


def test_export_check_covers_the_vision_method(llava, tmp_path, monkeypatch):
    from backends.mlx.llm.decoder.verify import VerificationError
    from backends.mlx.llm.decoder.verify_vision import verify_with_image

    directory, _ = llava
    model = T.AutoModelForImageTextToText.from_pretrained(str(directory), attn_implementation="eager").eval()
    right = vision_export.LlavaVision.forward
    monkeypatch.setattr(vision_export.LlavaVision, "forward", lambda self, pixels: right(self, pixels) * 1.05)
    from backends.mlx.llm.decoder.export import export_decoder

    files = {"processor_config.json": (directory / "processor_config.json").read_bytes()}
    export_decoder(model, tmp_path / "bad.pte", MAX_SEQ_LEN, tokenizer=str(directory), verify=False,
                   processor_files=files)
    monkeypatch.setattr(vision_export.LlavaVision, "forward", right)
    with pytest.raises(VerificationError, match="vision method differs from the eager vision forward"):
        verify_with_image(model, tmp_path / "bad.pte")


def test_unsupported_vision_language_family_is_refused_by_name(tmp_path, capsys):
    # PaliGemma (a SigLIP tower, prefix-LM attention over the image and prompt): not exported yet
    config = T.PaliGemmaConfig(text_config=dict(model_type="gemma", vocab_size=128, hidden_size=64,
                                                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2, head_dim=16),
                               vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                                                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                                  image_size=32, patch_size=8))
    T.PaliGemmaForConditionalGeneration(config).save_pretrained(tmp_path / "m")
    rc = main(["export", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "x.pte"), "--max-seq-len", "32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("etmlx: error: ") and "'paligemma' is a vision-language model" in err[-1]
    assert not (tmp_path / "x.pte").exists()


def test_a_text_only_program_refuses_images(tmp_path):
    import etmlx
    from backends.mlx.llm.decoder.export import export_decoder

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1)).eval()
    export_decoder(model, tmp_path / "t.pte", 32, verify=False)
    program = etmlx.load(tmp_path / "t.pte")
    with pytest.raises(ValueError, match="takes no images: it was exported from a text-only model"):
        list(program.stream([1, 2, 3], 2, images=[_image(0)]))
    _image(0).save(tmp_path / "i.png")  # the C++ decode loop too
    run = subprocess.run([str(tool_path("etmlx_decode")), str(tmp_path / "t.pte"), "--prompt-ids", "1,2,3",
                          "--image", str(tmp_path / "i.png")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().endswith("takes no images: it was exported from a text-only "
                                                               "model"), run.stderr


def test_the_server_engine_decodes_a_request_with_an_image(llava):
    from backends.mlx.llm.decoder.meta import DecoderMeta
    from backends.mlx.llm.sampler.params import SamplingParams
    from backends.mlx.runtime.runner import load_method
    from backends.mlx.serve.engine import Engine, EngineRequest

    directory, pte = llava
    meta = DecoderMeta.load(pte)
    engine = Engine(load_method(pte), meta, pte=pte)
    engine.running = True  # driven by hand, one loop turn at a time (as tests/test_serve_engine.py)
    image = _image(0)
    _, inputs, expected = _reference(directory, image)
    prompt = inputs.input_ids[0].tolist()
    results = []
    for _ in range(2):  # the same image twice: the second reuses the cached prefix and the encoded image
        events = []
        engine.submit(EngineRequest(list(prompt), SamplingParams(), STEPS, events.append, stop_at_eos=False,
                                    images=[image.copy()]))
        for _ in range(4 * STEPS):
            if events and events[-1].finish_reason:
                break
            engine._drain()
            engine._admit()
            if engine.active_rows:
                engine._step()
        results.append(events)
    assert [e.token for e in results[0]] == expected
    assert [e.token for e in results[1]] == expected
    assert results[1][0].cached_tokens == len(prompt) - 1 and engine.images.encoded == 1
    with pytest.raises(ValueError, match="image positions but no images"):
        engine.submit(EngineRequest(list(prompt), SamplingParams(), STEPS, lambda e: None))
    # one placeholder per image (an LMTP client's prompt): expanded to the image's positions, the same tokens
    image_id = meta.image_token_id
    short = [t for i, t in enumerate(prompt) if t != image_id or prompt[i - 1] != image_id]
    events = []
    engine.submit(EngineRequest(short, SamplingParams(), STEPS, events.append, stop_at_eos=False, images=[image]))
    for _ in range(4 * STEPS):
        if events and events[-1].finish_reason:
            break
        engine._drain()
        engine._admit()
        if engine.active_rows:
            engine._step()
    assert short.count(image_id) == 1 and [e.token for e in events] == expected


@pytest.mark.server
def test_a_chat_request_with_an_image_url_decodes_transformers_tokens(llava):
    import base64
    import io
    import json
    import urllib.request

    from backends.mlx.serve.app import ServerThread

    directory, pte = llava
    image = _image(0)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t99 t3"}]}]
    _, _, expected = _reference(directory, image, messages)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "t99 t3"}]}],
            "max_tokens": STEPS, "temperature": 0}
    server = ServerThread(pte, model_name="llava", lmtp_port=None).start()
    try:
        for _ in range(2):  # the second: the same image, from the prompt cache
            request = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                out = json.loads(response.read())
            assert out["choices"][0]["message"]["content"].split() == [f"t{t}" for t in expected], out
    finally:
        server.stop()
