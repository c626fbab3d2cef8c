"""Images in server requests (serve/image_parts.py): OpenAI image_url parts and LMTP "images" are counted, checked
and decoded off the event loop; each bad image is a 400 naming the part, a text-only program refuses every image,
local files only under --allow-local-images DIR, remote URLs never fetched, and /health answers meanwhile.

The served program here is the tiny text-only decoder; where a test needs a server that takes images, it turns the
service's image input on (ImageInputs(takes_images=True)): what is tested is the input layer, which runs before
the prompt is rendered."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import os
import struct
import time
import urllib.error
import urllib.request
import zlib

import aiohttp
import numpy as np
import pytest
from PIL import Image

from backends.mlx.cli.main import build_parser
from backends.mlx.llm.vision.images import ImageLimits, load_image
from backends.mlx.serve.api_errors import ApiError
from backends.mlx.serve.app import ServeLimits, ServerThread
from backends.mlx.serve.image_parts import ImageInputs, generate_sources, image_parts
from serve_helpers import lmtp_exchange, tiny_pte


def _png(width=24, height=16, seed=0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _url(data: bytes, media="image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _bomb() -> bytes:
    """A valid 20,000 x 20,000 1-bit PNG of ~50 KB."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    packer = zlib.compressobj(9)
    row = bytes(1 + 2500)
    idat = b"".join(packer.compress(row) for _ in range(20_000)) + packer.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20_000, 20_000, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def _chat(*urls, text="describe") -> dict:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}


# ---- parsing and sources, without a server ----

def test_image_parts_become_image_placeholders_in_order():
    first, second = _url(_png(seed=1)), _url(_png(seed=2))
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": first, "detail": "low"}},
                                             {"type": "text", "text": "and"},
                                             {"type": "image_url", "image_url": {"url": second}}]}]
    out, sources = image_parts(messages)
    assert out[0] is messages[0]
    assert out[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    assert sources == [("messages[1].content[0]", first), ("messages[1].content[2]", second)]
    assert messages[1]["content"][0]["type"] == "image_url"  # the client's body is not modified
    assert image_parts("not a list") == ("not a list", [])


@pytest.mark.parametrize("part, words", [
    ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}, ["must be an object with a string 'url'"]),
    ({"type": "image_url"}, ["must be an object"]),
    ({"type": "image_url", "image_url": {"url": "x", "size": 3}}, ["unknown field 'size'"]),
    ({"type": "image_url", "image_url": {"url": "x", "detail": "max"}}, ["detail must be one of"]),
])
def test_bad_image_part_shapes_are_400s_naming_the_part(part, words):
    with pytest.raises(ApiError) as info:
        image_parts([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    assert info.value.status == 400 and "messages[0].content[1]" in info.value.message
    for word in words:
        assert word in info.value.message


def test_the_count_checks():
    ImageInputs(takes_images=True, max_images=2).check_count(2, "m")
    with pytest.raises(ApiError, match="has 3 images; this server takes at most 2"):
        ImageInputs(takes_images=True, max_images=2).check_count(3, "m")
    with pytest.raises(ApiError, match="'m' takes no images"):
        ImageInputs().check_count(1, "m")
    ImageInputs().check_count(0, "m")  # text only: nothing to refuse


def _decode(inputs: ImageInputs, url: str):
    return asyncio.run(inputs.decode([("messages[0].content[1]", url)]))


def test_data_urls_decode_to_the_same_pixels():
    data = _png()
    (image,) = _decode(ImageInputs(takes_images=True), _url(data))
    assert np.array_equal(np.asarray(image), np.asarray(load_image(data)))


@pytest.mark.parametrize("url, words", [
    ("https://example.com/cat.png", ["remote image URLs are not fetched"]),
    ("http://127.0.0.1:1/cat.png", ["remote image URLs are not fetched"]),
    ("ftp://example.com/cat.png", ["remote"]),
    ("gopher://x/y", ["must be data: URLs", "gopher"]),
    ("file:///etc/hostname", ["local image files are off", "--allow-local-images"]),
    ("/etc/hostname", ["local image files are off"]),
])
def test_only_data_urls_without_the_flag(url, words):
    with pytest.raises(ApiError) as info:
        _decode(ImageInputs(takes_images=True), url)
    assert info.value.status == 400 and info.value.message.startswith("messages[0].content[1]: ")
    for word in words:
        assert word in info.value.message


def test_local_files_only_under_the_allowed_directory(tmp_path):
    allowed = (tmp_path / "allowed").resolve()
    (allowed / "sub").mkdir(parents=True)
    data = _png(seed=5)
    (allowed / "sub" / "cat.png").write_bytes(data)
    outside = tmp_path / "secret.png"
    outside.write_bytes(data)
    os.symlink(outside, allowed / "link.png")  # a link out of the directory
    inputs = ImageInputs(takes_images=True, local_dir=allowed)
    expected = np.asarray(load_image(data))
    for url in (f"file://{allowed}/sub/cat.png", str(allowed / "sub" / "cat.png"), "sub/cat.png",
                f"file://localhost{allowed}/sub/cat.png"):
        assert np.array_equal(np.asarray(_decode(inputs, url)[0]), expected), url
    for url, words in ((str(outside), "outside the directory"), (f"file://{outside}", "outside the directory"),
                       (str(allowed / "link.png"), "outside the directory"), ("sub/../../secret.png", "outside"),
                       ("sub/nope.png", "no such image file"), ("file://otherhost/x.png", "local file")):
        with pytest.raises(ApiError, match=words):
            _decode(inputs, url)


def test_lmtp_images_field_shape():
    assert generate_sources(None) == []
    assert generate_sources(["data:a", "data:b"]) == [("images[0]", "data:a"), ("images[1]", "data:b")]
    for bad in ("data:a", [1], [""]):
        with pytest.raises(ApiError, match="'images' must be a list of image URLs"):
            generate_sources(bad)


def test_the_serve_flags(tmp_path):
    args = build_parser().parse_args(["serve", "x.pte", "--allow-local-images", str(tmp_path), "--max-images", "3",
                                      "--max-image-pixels", "1000", "--max-image-bytes", "2000"])
    assert (args.allow_local_images, args.max_images, args.max_image_pixels, args.max_image_bytes) == \
        (str(tmp_path), 3, 1000, 2000)
    ServeLimits(allow_local_images=tmp_path).check()
    with pytest.raises(ValueError, match="not a directory"):
        ServeLimits(allow_local_images=tmp_path / "nope").check()
    with pytest.raises(ValueError, match="max-images"):
        ServeLimits(max_images=0).check()


# ---- the server ----

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerThread(tiny_pte(tmp_path_factory), model_name="tiny", lmtp_port=None).start()
    yield srv
    srv.stop()


@pytest.fixture
def takes_images(server):
    """The service's image input turned on (at most 2 images), as a vision-language program's would be."""
    before = server.service.images
    server.service.images = ImageInputs(takes_images=True, max_images=2, limits=ImageLimits(max_bytes=1 << 20))
    yield server.service.images
    server.service.images = before


def _post(server, body: dict):
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.server
def test_a_text_only_program_refuses_images_and_serves_text(server):
    status, out = _post(server, _chat(_url(_png())))
    assert status == 400 and out["error"]["message"] == \
        "the model 'tiny' takes no images (a text-only program): send text only", out
    assert out["error"]["param"] == "messages"
    status, out = _post(server, _chat())  # the same chat without its image: served
    assert status == 200 and out["choices"][0]["message"]["role"] == "assistant", out


@pytest.mark.server
def test_lmtp_images_on_a_text_only_program(server):
    frames = ['MODEL_INFO {"stream_id": 1}',
              'GENERATE ' + json.dumps({"stream_id": 2, "prompt": [1, 2], "images": [_url(_png())]}),
              'GENERATE ' + json.dumps({"stream_id": 3, "prompt": [1, 2], "max_tokens": 2})]
    done = lambda ms: (any(k == "MSG" for k, _ in ms)  # noqa: E731
                       and {e["stream_id"] for k, p in ms if k == "TOKEN" for e in p if e["finish_reason"]} >= {2, 3})
    messages = asyncio.run(lmtp_exchange(server, frames, done))
    info = next(p for k, p in messages if k == "MSG")["model_info"]
    assert info["max_images"] == 0
    errors = [e for k, p in messages if k == "TOKEN" for e in p if e["stream_id"] == 2]
    assert errors == [{"stream_id": 2, "error": "the model 'tiny' takes no images (a text-only program): send text "
                                                "only", "finish_reason": "error"}]
    ended = [e for k, p in messages if k == "TOKEN" for e in p if e["stream_id"] == 3 and e["finish_reason"]]
    assert ended and "error" not in ended[0]  # the connection and the next stream carry on


def _truncated() -> bytes:
    data = _png(64, 64)
    return data[:len(data) // 2]


def _tiff() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, format="TIFF")
    return out.getvalue()


BAD = [
    (lambda: _url(_bomb()), "400000000 pixels"),
    (lambda: _url(_truncated()), "corrupt or truncated"),
    (lambda: _url(_tiff()), "a TIFF image"),
    (lambda: "data:image/png;base64,@@@@", "base64 is invalid"),
    (lambda: _url(b"x" * (2 << 20)), "at most 1048576"),
    (lambda: "https://example.com/a.png", "not fetched"),
]


@pytest.mark.server
@pytest.mark.parametrize("make, words", BAD)
def test_each_bad_image_is_a_400_naming_the_part(server, takes_images, make, words):
    status, out = _post(server, _chat(_url(_png()), make()))
    message = out["error"]["message"]
    assert status == 400 and message.startswith("messages[0].content[2]: ") and words in message, out
    assert "\n" not in message


@pytest.mark.server
def test_more_images_than_allowed_is_a_400(server, takes_images):
    status, out = _post(server, _chat(*[_url(_png(seed=i)) for i in range(3)]))
    assert status == 400 and "has 3 images; this server takes at most 2" in out["error"]["message"], out


@pytest.mark.server
def test_health_answers_while_bad_images_are_posted(server, takes_images):
    """Eight clients post chats with a large RGBA PNG that decodes fine (3000 x 3000: ~90 KB to send, ~0.5 s to
    decode) then a truncated image and a bomb; each is a 400 naming the truncated one, and /health keeps answering
    200 meanwhile, its p99 under one decode of the large image (measured in this run): the decoding runs in
    threads, two at a time, not on the event loop."""
    n, rng = 3000, np.random.default_rng(3)
    pixels = np.zeros((n, n, 4), dtype=np.uint8)
    pixels[..., 3] = 200
    pixels[::97, ::89] = rng.integers(0, 256, pixels[::97, ::89].shape)
    heavy = io.BytesIO()
    Image.fromarray(pixels).save(heavy, format="PNG")
    server.service.images = dataclasses.replace(takes_images, max_images=3)
    started = time.perf_counter()
    load_image(heavy.getvalue(), ImageLimits(max_bytes=1 << 30))
    one_decode = time.perf_counter() - started
    body = json.dumps(_chat(_url(heavy.getvalue()), _url(_truncated()), _url(_bomb()))).encode()

    async def script():
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async def post():
                async with session.post(server.url + "/v1/chat/completions", data=body,
                                        headers={"Content-Type": "application/json"}) as r:
                    return r.status, (await r.json())["error"]["message"]

            posts = [asyncio.ensure_future(post()) for _ in range(8)]
            latencies = []
            while not all(p.done() for p in posts):
                start = loop.time()
                async with session.get(server.url + "/health") as r:
                    assert r.status == 200
                    await r.read()
                latencies.append(loop.time() - start)
                await asyncio.sleep(0.01)
            return latencies, [p.result() for p in posts]

    latencies, results = asyncio.run(script())
    assert all(status == 400 and message.startswith("messages[0].content[2]: ") for status, message in results), \
        results[:2]
    p99 = sorted(latencies)[int(0.99 * (len(latencies) - 1))]
    print(f"/health p99 {p99 * 1000:.1f} ms over {len(latencies)} probes; one decode of the heavy image "
          f"{one_decode * 1000:.0f} ms")
    assert len(latencies) >= 3 and p99 < one_decode


@pytest.mark.server
def test_lmtp_bad_images_are_stream_errors_naming_the_image(server, takes_images):
    two = [_url(_png()), _url(_truncated())]
    frames = ['GENERATE ' + json.dumps({"stream_id": 1, "prompt": [1, 2], "images": two}),
              'GENERATE ' + json.dumps({"stream_id": 2, "prompt": [1, 2], "images": "data:image/png;base64,AA"}),
              'GENERATE ' + json.dumps({"stream_id": 3, "prompt": [1, 2], "images": [_url(_png())] * 3}),
              'MODEL_INFO {"stream_id": 4}']
    done = lambda ms: (any(k == "MSG" for k, _ in ms)  # noqa: E731
                       and {e["stream_id"] for k, p in ms if k == "TOKEN" for e in p if e["finish_reason"]}
                       >= {1, 2, 3})
    messages = asyncio.run(lmtp_exchange(server, frames, done))
    errors = {e["stream_id"]: e["error"] for k, p in messages if k == "TOKEN" for e in p if e.get("error")}
    assert errors[1].startswith("images[1]: the PNG image is corrupt or truncated"), errors
    assert errors[2] == "'images' must be a list of image URLs (data:image/...;base64,...)"
    assert "has 3 images; this server takes at most 2" in errors[3]
    assert next(p for k, p in messages if k == "MSG")["model_info"]["max_images"] == 2
