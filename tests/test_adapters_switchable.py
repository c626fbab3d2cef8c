"""`etmlx export --adapters NAME=DIR,...`: LoRA adapters kept unfused, chosen per request. With each adapter the
program decodes to the tokens of the program that fuses it (`--adapter DIR`) and of its own library (transformers
+ PEFT, mlx-lm, unfused as here); without one, to the base model's; rows on different adapters share a call and
each gets the tokens it gets alone; the prompt cache is never reused across adapters; bad adapters and unknown
names are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from adapter_helpers import (PROMPT, STEPS, checkpoint, distinct, export, mlx_lm_adapter, mlx_lm_greedy,
                             peft_adapter, torch_greedy)
from backends.mlx.cli.main import main
from backends.mlx.llm.decoder.decode_rows import DecodeRows, Sequence
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.sampler.params import SamplingParams
from helpers import etmlx_decode_json

# Whole decoder exports: the slow tier (make test), not make test-fast.
pytestmark = pytest.mark.slow


def _adapters(tmp_path, base_dir):
    """A PEFT adapter (rank 4, 8 on down_proj) and an mlx-lm one of rank 2 (padded to 8 in the program)."""
    return peft_adapter(base_dir, tmp_path / "peft"), mlx_lm_adapter(tmp_path / "mlx", rank=2, seed=5)


def _switchable(base_dir, out, peft, mlx, *flags) -> Decoder:
    assert main(["export", "--model", str(base_dir), "--out", str(out), "--max-seq-len", "96",
                 "--adapters", f"a={peft},b={mlx}", *flags]) == 0
    return Decoder(out)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_adapter_decodes_as_fused_and_as_its_library(tmp_path, family):
    from mlx_lm import load
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = checkpoint(tmp_path / "base", family=family)
    peft, mlx = _adapters(tmp_path, base_dir)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    base_tokens = torch_greedy(base)
    peft_tokens = torch_greedy(PeftModel.from_pretrained(base, str(peft)).eval())  # unfused
    mlx_tokens = mlx_lm_greedy(load(str(base_dir), adapter_path=str(mlx))[0])  # unfused
    distinct(peft_tokens, base_tokens)
    distinct(mlx_tokens, base_tokens)
    assert peft_tokens != mlx_tokens

    decoder = _switchable(base_dir, tmp_path / "switchable.pte", peft, mlx)
    assert decoder.meta.adapters == ["a", "b"]
    assert decoder.generate(PROMPT, STEPS).tokens == base_tokens
    assert decoder.generate(PROMPT, STEPS, adapter="a").tokens == peft_tokens
    assert decoder.generate(PROMPT, STEPS, adapter="b").tokens == mlx_tokens
    assert decoder.generate(PROMPT, STEPS).tokens == base_tokens  # back to none: nothing stuck
    assert export(base_dir, tmp_path / "fused-a.pte", "--adapter", str(peft)) == peft_tokens
    assert export(base_dir, tmp_path / "fused-b.pte", "--adapter", str(mlx)) == mlx_tokens


@pytest.mark.subprocess
def test_rows_on_different_adapters_share_a_call(tmp_path):
    """A 3-row program: rows on a, b and none in the same calls (the same prompt, so only the adapter input tells
    them apart) each get the tokens they get alone; the prompt cache is not reused across adapters; the C++
    etmlx_decode runs the base model or the adapter --adapter-name picks."""
    base_dir = checkpoint(tmp_path / "base")
    peft, mlx = _adapters(tmp_path, base_dir)
    decoder = _switchable(base_dir, tmp_path / "batch.pte", peft, mlx, "--batch", "3")
    names = ["a", "b", None]
    alone = {name: decoder.generate(PROMPT, STEPS, adapter=name).tokens for name in names}
    assert len({tuple(t) for t in alone.values()}) == 3

    rows = DecodeRows(decoder.meta)
    for slot, name in enumerate(names):
        rows.start(slot, Sequence(list(PROMPT), SamplingParams(), STEPS, adapter=decoder.meta.adapter_index(name)))
    together = {slot: [] for slot in range(3)}
    while rows.active:
        for slot, _, event in rows.read(decoder.method.execute(rows.call_inputs())):
            together[slot].append(event.token)
    assert [together[slot] for slot in range(3)] == [alone[name] for name in names]
    decoder.rows.forget()  # those calls wrote every row's cache behind the decoder's own rows

    # The prompt cache: a row that holds the prompt written without an adapter prefills it again for one.
    assert [s.token for s in decoder.stream(PROMPT, STEPS, reuse=True)] == alone[None]
    assert [s.token for s in decoder.stream(PROMPT, STEPS, reuse=True, adapter="a")] == alone["a"]
    assert decoder.last_cached == 0
    assert [s.token for s in decoder.stream(PROMPT, STEPS, reuse=True, adapter="a")] == alone["a"]
    assert decoder.last_cached == len(PROMPT) - 1  # the same adapter reuses it (the last token is fed again)
    # The C++ decode loop: the base model by default, an adapter by name; a name the program lacks is refused.
    for name in names:
        flags = ("--adapter-name", name) if name else ()
        assert etmlx_decode_json(tmp_path / "batch.pte", PROMPT, STEPS, *flags)["tokens"] == alone[name]
    wrong = etmlx_decode_json(tmp_path / "batch.pte", PROMPT, STEPS, "--adapter-name", "c", check=False)
    assert wrong.returncode != 0
    assert wrong.stderr.strip().splitlines()[-1].endswith("--adapter-name c: not one of the program's adapters (a, b)")


def test_adapters_on_a_quantized_base_decode_as_mlx_lm(tmp_path):
    """The LoRA part stays float beside quantized layers: an mlx-lm 4-bit directory with an adapter decodes as
    mlx-lm's LoRA layers over its quantized ones (mlx_lm.load(..., adapter_path)), and --quantize int8 of a float
    checkpoint as mlx-lm's model with the adapter quantized by nn.quantize (its LoRA kept float)."""
    import mlx.nn as nn
    from mlx_lm import convert, load

    base_dir = checkpoint(tmp_path / "base")
    peft, mlx = _adapters(tmp_path, base_dir)
    quantized = tmp_path / "q4"
    convert(str(base_dir), str(quantized), quantize=True, q_group_size=64, q_bits=4, dtype="float32")
    steps = 24
    expected = mlx_lm_greedy(load(str(quantized), adapter_path=str(mlx))[0], steps)
    plain = mlx_lm_greedy(load(str(quantized))[0], steps)
    distinct(expected, plain)
    decoder = _switchable(quantized, tmp_path / "q4.pte", peft, mlx)
    assert decoder.generate(PROMPT, steps, adapter="b").tokens == expected
    assert decoder.generate(PROMPT, steps).tokens == plain

    theirs = load(str(base_dir), adapter_path=str(mlx))[0]
    nn.quantize(theirs, group_size=64, bits=8)
    assert type(theirs.model.layers[0].self_attn.q_proj.linear).__name__ == "QuantizedLinear"
    expected = mlx_lm_greedy(theirs)
    decoder = _switchable(base_dir, tmp_path / "q8.pte", peft, mlx, "--quantize", "int8")
    assert decoder.generate(PROMPT, STEPS, adapter="b").tokens == expected


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("etmlx: error: "), lines
    return lines[-1]


def test_bad_adapters_are_refused_in_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    import etmlx

    base_dir = checkpoint(tmp_path / "base")
    peft, mlx = _adapters(tmp_path, base_dir)
    out = tmp_path / "bad.pte"
    export_argv = ["export", "--model", str(base_dir), "--out", str(out), "--adapters"]
    assert "--adapters: name 'a' is given twice" in _error(capsys, export_argv + [f"a={peft},a={mlx}"])
    assert "--adapters: name 'a:b' must be letters" in _error(capsys, export_argv + [f"a:b={peft}"])
    assert "--adapters: 'a' is not NAME=DIR" in _error(capsys, export_argv + ["a"])
    assert f"--adapters: b={tmp_path}/nowhere: not a directory" in \
        _error(capsys, export_argv + [f"a={peft},b={tmp_path}/nowhere"])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"--adapters: a={empty}: holds neither adapters.safetensors" in _error(capsys, export_argv + [f"a={empty}"])
    with pytest.raises(ValueError, match=r"^adapters: a=\S+: holds neither"):  # the Python API's name
        etmlx.export(base_dir, out, adapters={"a": empty})
    no_config = mlx_lm_adapter(tmp_path / "no-config")
    (no_config / "adapter_config.json").unlink()
    assert "no adapter_config.json" in _error(capsys, export_argv + [f"a={no_config}"])
    # An adapter for a wider base: its shapes are not this model's (checked once the model is loaded).
    wide = mlx_lm_adapter(tmp_path / "wide", hidden=192)
    assert f"--adapters: w={wide}: model.layers.0.mlp.down_proj: its update is 192x256 (out x in) but the base " \
           "layer is 128x256" in _error(capsys, export_argv + [f"a={peft},w={wide}"])
    # A and B of different ranks.
    tensors = load_file(str(peft / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[name] = tensors[name][:, :3].contiguous()
    save_file(tensors, str(peft / "adapter_model.safetensors"))
    assert "model.layers.0.self_attn.q_proj: rank mismatch between its A [4, 128] and B [128, 3]" in \
        _error(capsys, export_argv + [f"a={peft}"])
    assert "--adapters: switchable adapters need a plain program" in \
        _error(capsys, export_argv + [f"b={mlx}", "--draft-tokens", "2"])
    assert not out.exists()

    # Choosing a name the program does not have.
    good = tmp_path / "good.pte"
    assert main(["export", "--model", str(base_dir), "--out", str(good), "--max-seq-len", "64",
                 "--adapters", f"b={mlx}"]) == 0
    assert "adapter 'zz' is not in this program (its adapters are b)" in \
        _error(capsys, ["generate", str(good), "--prompt-ids", "5,17", "--adapter-name", "zz"])
    model = etmlx.load(good)
    with pytest.raises(ValueError, match="adapter 'zz' is not in this program"):
        etmlx.generate(model, [5, 17], 4, adapter="zz")
    assert etmlx.generate(model, PROMPT, 12, adapter="b") != etmlx.generate(model, PROMPT, 12)
    assert main(["inspect", str(good)]) == 0
    assert "switchable adapters: b" in capsys.readouterr().out


@pytest.mark.server
def test_server_picks_the_adapter_per_request(tmp_path):
    """OpenAI: "model": "BASE:NAME" or an "adapter" field; LMTP: the same in GENERATE; /v1/models lists them; an
    unknown name is a 400 (OpenAI) or a stream error (LMTP)."""
    import asyncio

    import aiohttp

    from backends.mlx.serve.app import ServerThread

    base_dir = checkpoint(tmp_path / "base")
    peft, mlx = _adapters(tmp_path, base_dir)
    decoder = _switchable(base_dir, tmp_path / "served.pte", peft, mlx, "--batch", "2")
    alone = {name: decoder.generate(PROMPT, 12, adapter=name).tokens for name in ("a", "b", None)}
    del decoder
    server = ServerThread(tmp_path / "served.pte", model_name="base", lmtp_port=0).start()
    try:
        async def run():
            async with aiohttp.ClientSession() as session:
                async def complete(**fields):
                    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **fields}
                    async with session.post(f"{server.url}/v1/completions", json=body) as response:
                        return response.status, await response.json()

                answers = await asyncio.gather(complete(model="base:a"), complete(adapter="a"),
                                               complete(model="base:b"), complete(model="base"),
                                               complete(model="base:zz"), complete(adapter="b", model="base:a"))
                async with session.get(f"{server.url}/v1/models") as response:
                    models = [m["id"] for m in (await response.json())["data"]]
                async with session.ws_connect(f"{server.url}/lmtp") as ws:
                    for i, fields in enumerate([{"model": "base:b"}, {"adapter": "a"}, {"adapter": "zz"}]):
                        await ws.send_str("GENERATE " + json.dumps({"stream_id": i, "prompt": PROMPT,
                                                                    "max_tokens": 12, **fields}))
                    lmtp, errors = {0: [], 1: []}, {}
                    while len(errors) < 1 or any(len(t) < 12 for t in lmtp.values()):
                        for line in (await asyncio.wait_for(ws.receive_str(), 120)).splitlines():
                            kind, _, data = line.partition(" ")
                            payload = json.loads(data)
                            for item in payload if kind == "TOKEN" else [payload]:
                                if item.get("error"):
                                    errors[item["stream_id"]] = item["error"]
                                elif kind == "TOKEN":
                                    lmtp[item["stream_id"]].append(item["token"])
                return answers, models, lmtp, errors

        answers, models, lmtp, errors = asyncio.run(run())
    finally:
        server.stop()
    texts = [body["choices"][0]["text"] if status == 200 else None for status, body in answers[:4]]
    assert [status for status, _ in answers[:4]] == [200] * 4
    assert texts[0] == texts[1] and len({texts[0], texts[2], texts[3]}) == 3
    assert answers[4][0] == 400 and "adapter 'zz' is not in this program" in answers[4][1]["error"]["message"]
    assert answers[5][0] == 400 and "'adapter' is 'b' but 'model' names adapter 'a'" in \
        answers[5][1]["error"]["message"]
    assert models == ["base", "base:a", "base:b"]
    assert lmtp == {0: alone["b"], 1: alone["a"]}
    assert "adapter 'zz' is not in this program" in errors[2]
