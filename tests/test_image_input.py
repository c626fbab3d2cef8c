"""Image input (llm/vision/images.py): every source to the same RGB pixels, transformers' RGB rules (EXIF
orientation, transparency onto white), and hostile files (made here with Pillow or by hand) refused in one line
before they cost memory."""

from __future__ import annotations

import base64
import io
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, features

from backends.mlx.llm.vision.images import MAX_BYTES_PER_PIXEL, ImageInputError, ImageLimits, image_digest, load_image

ORIENTATION = 0x0112


def _encoded(image: Image.Image, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def _noise(width=37, height=23, mode="RGB", seed=0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels)


def _refused(source, *words, limits=ImageLimits()) -> str:
    with pytest.raises(ImageInputError) as info:
        load_image(source, limits)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    for word in words:
        assert word in message, message
    return message


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _bilevel_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of width x height (all black), compressed row by row: a 20,000 x 20,000 one is ~50 KB
    on disk and 400 million pixels decoded."""
    row = b"\x00" + bytes((width + 7) // 8)  # filter byte, then the packed bits
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", idat)
            + _png_chunk(b"IEND", b""))


# ---- every source, the same pixels ----

def test_path_bytes_data_url_and_pil_give_the_same_rgb_pixels(tmp_path):
    image = _noise()
    data = _encoded(image, "PNG")
    path = tmp_path / "noise.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    loaded = [load_image(s) for s in (image, str(path), path, data, url)]
    for one in loaded:
        assert one.mode == "RGB" and one.size == (37, 23)
        assert np.array_equal(np.asarray(one), np.asarray(image))
    assert len({image_digest(one) for one in loaded}) == 1


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "GIF", "WEBP", "JPEG"])
def test_each_allowed_format_loads(fmt):
    if fmt == "WEBP" and not features.check("webp"):
        pytest.fail("Pillow was built without WebP, which the allowed formats promise")
    image = Image.new("RGB", (16, 8), (200, 40, 90))
    loaded = load_image(_encoded(image, fmt, **({"lossless": True} if fmt == "WEBP" else {})))
    tolerance = 8 if fmt in ("JPEG", "GIF") else 0  # lossy / palette quantised
    assert loaded.size == (16, 8)
    assert np.abs(np.asarray(loaded, dtype=int) - (200, 40, 90)).max() <= tolerance


def test_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    data = _encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert Image.open(io.BytesIO(data)).n_frames == 3
    assert np.asarray(load_image(data))[0, 0].tolist() == [255, 0, 0]


# ---- normalised to RGB as transformers does ----

def test_alpha_is_composited_onto_white():
    pixels = np.zeros((2, 3, 4), dtype=np.uint8)
    pixels[..., :3] = (10, 20, 30)
    pixels[0, 0, 3], pixels[0, 1, 3], pixels[0, 2, 3] = 0, 255, 128
    loaded = np.asarray(load_image(_encoded(Image.fromarray(pixels), "PNG")), dtype=int)
    assert loaded[0, 0].tolist() == [255, 255, 255]  # transparent: the white behind it
    assert loaded[0, 1].tolist() == [10, 20, 30]  # opaque: itself
    expected = np.round(np.array([10, 20, 30]) * 128 / 255 + 255 * 127 / 255)
    assert np.abs(loaded[0, 2] - expected).max() <= 1  # half: the blend


def test_palette_transparency_is_composited_onto_white():
    image = Image.new("P", (4, 1), 0)
    image.putpalette([0, 0, 0, 250, 10, 10] + [0] * 762)
    image.putpixel((1, 0), 1)
    loaded = np.asarray(load_image(_encoded(image, "GIF", transparency=0)))
    assert loaded[0, 0].tolist() == [255, 255, 255] and loaded[0, 1].tolist() == [250, 10, 10]


def test_cmyk_jpeg_and_grey_become_rgb():
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # pure red in CMYK
    red = np.asarray(load_image(_encoded(cmyk, "JPEG", quality=100)), dtype=int)
    assert red.shape == (8, 8, 3) and np.abs(red[0, 0] - (255, 0, 0)).max() <= 4
    grey = load_image(_encoded(Image.new("L", (3, 3), 77), "PNG"))
    assert grey.mode == "RGB" and np.asarray(grey)[1, 1].tolist() == [77, 77, 77]


def test_16_bit_grey_is_scaled_not_clipped():
    values = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    data = _encoded(Image.fromarray(values), "PNG")
    assert Image.open(io.BytesIO(data)).mode.startswith("I")  # it really is a 16-bit PNG
    assert np.asarray(load_image(data))[0, :, 0].tolist() == [0, 1, 128, 255]


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_exif_orientation_is_applied(orientation):
    """A 3 x 2 image with a red top-left pixel, its EXIF orientation set: the loaded image is as a viewer shows
    it (6: rotated 90 degrees clockwise, so 2 x 3 with the red pixel top right; 8: counter-clockwise)."""
    image = Image.new("RGB", (3, 2), (0, 0, 0))
    image.putpixel((0, 0), (255, 0, 0))
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    loaded = load_image(_encoded(image, "PNG", exif=exif))
    assert loaded.size == ((3, 2) if orientation in (1, 3) else (2, 3))
    red = [(x, y) for y in range(loaded.size[1]) for x in range(loaded.size[0])
           if loaded.getpixel((x, y)) == (255, 0, 0)]
    assert red == [{1: (0, 0), 3: (2, 1), 6: (1, 0), 8: (0, 2)}[orientation]]


# ---- hostile input ----

def test_a_20000_square_png_bomb_is_refused_before_decoding():
    bomb = _bilevel_png(20_000, 20_000)
    assert len(bomb) < 200_000
    _refused(bomb, str(20_000 * 20_000), "decompression bomb")
    _refused(_bilevel_png(5000, 5000), "5000 x 5000", "decompression bomb")  # under Pillow's own limit
    assert load_image(_bilevel_png(200, 100)).size == (200, 100)  # control: the writer makes valid PNGs


def test_the_pixel_cap_is_the_stated_one():
    image = _encoded(Image.new("RGB", (64, 64)), "PNG")
    assert load_image(image, ImageLimits(max_pixels=64 * 64)).size == (64, 64)
    _refused(image, "64 x 64", str(64 * 64 - 1), limits=ImageLimits(max_pixels=64 * 64 - 1))
    _refused(Image.new("RGB", (64, 64)), "64 x 64", limits=ImageLimits(max_pixels=100))  # a PIL image too


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_truncated_images_are_refused(fmt):
    data = _encoded(_noise(64, 64), fmt)
    _refused(data[:len(data) // 2])


def test_corrupt_png_data_is_refused():
    data = bytearray(_encoded(_noise(64, 64), "PNG"))
    start = data.index(b"IDAT") + 4
    data[start + 40:start + 400] = b"\xff" * 360  # garbage inside the compressed pixels
    _refused(bytes(data), "corrupt")


@pytest.mark.parametrize("data, name", [
    (lambda: _encoded(Image.new("RGB", (4, 4)), "TIFF"), "TIFF"),
    (lambda: b"\x00\x00\x00\x18ftypheic" + bytes(64), "HEIC"),
    (lambda: b"  <svg xmlns='http://www.w3.org/2000/svg'/>", "SVG"),
    (lambda: b"%PDF-1.7\n" + bytes(64), "PDF"),
])
def test_other_formats_are_refused_by_name(data, name):
    _refused(data(), "unsupported image", name, "PNG, JPEG, WebP, GIF or BMP")


def test_random_bytes_and_empty_input_are_refused():
    _refused(np.random.default_rng(1).bytes(4096), "unsupported image")
    _refused(b"", "empty")


def test_oversize_bytes_are_refused_from_every_source(tmp_path):
    data = _encoded(_noise(), "PNG")
    limits = ImageLimits(max_bytes=len(data) - 1)
    path = tmp_path / "big.png"
    path.write_bytes(data)
    _refused(data, str(len(data)), limits=limits)
    _refused(path, str(len(data)), limits=limits)
    # a data URL is refused by its length, before the base64 is decoded (this one is not even valid base64)
    _refused("data:image/png;base64," + "!" * (4 * len(data)), "at most", limits=limits)
    assert load_image(data, ImageLimits(max_bytes=len(data))).size == (37, 23)


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,iVBOR!!", ["base64 is invalid"]),
    ("data:text/plain;base64,aGVsbG8=", ["media type", "text/plain"]),
    ("data:image/png,%89PNG", ["not base64"]),
    ("data:image/png;base64", ["no ','"]),
])
def test_bad_data_urls_are_refused(url, words):
    _refused(url, *words)


def test_missing_files_and_other_types_are_refused(tmp_path):
    _refused(tmp_path / "nope.png", "cannot read")
    _refused(tmp_path, "not a file")
    _refused(12345, "not int")


def test_limits_are_checked():
    ImageLimits().check()
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0).check()


def test_the_digest_keys_on_size_and_pixels():
    image = _noise()
    same_pixels_elsewhere = load_image(_encoded(image, "BMP"))
    assert image_digest(image) == image_digest(same_pixels_elsewhere)
    changed = image.copy()
    changed.putpixel((5, 5), tuple(255 - v for v in image.getpixel((5, 5))))
    assert image_digest(changed) != image_digest(image)
    flat = Image.frombytes("RGB", (23, 37), image.tobytes())  # the same bytes, another shape
    assert image_digest(flat) != image_digest(image)
    assert len(image_digest(image)) == 64


PEAK_PROBE = """
import sys
from backends.mlx.llm.vision.images import ImageLimits, load_image

def status(key):
    return next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith(key + ':'))

data = open(sys.argv[1], 'rb').read()
open('/proc/self/clear_refs', 'w').write('5')  # the peak (VmHWM) starts again from the current RSS
before = status('VmRSS')
image = load_image(data, ImageLimits(max_bytes=1 << 30))
print((status('VmHWM') - before) * 1024 / (image.width * image.height))
"""

def _large(mode: str, side: int) -> tuple[Image.Image, dict]:
    """A side x side image in `mode`, smooth (a small file) with some noise (real decoding work)."""
    y, x = np.mgrid[0:side, 0:side]
    base = ((x + y) % 256).astype(np.uint8)
    base[::7, ::5] = np.random.default_rng(0).integers(0, 256, base[::7, ::5].shape, dtype=np.uint8)
    if mode == "I;16":
        return Image.fromarray(base.astype(np.uint16) * 257), {}
    grey = Image.fromarray(base)
    if mode == "P":
        return grey.convert("P"), {"transparency": 0}
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    return Image.merge(mode, [grey] * len(mode)), ({"exif": exif} if mode in ("RGB", "CMYK") else {})


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures the peak through Linux's /proc")
@pytest.mark.parametrize("mode, fmt", [("RGB", "PNG"), ("RGB", "JPEG"), ("CMYK", "JPEG"), ("RGBA", "PNG"),
                                       ("LA", "PNG"), ("P", "PNG"), ("I;16", "PNG")])
def test_loading_stays_within_the_stated_memory(tmp_path, mode, fmt):
    """Peak RSS growth while loading a 3000 x 3000 image, in a fresh interpreter (Linux: the peak reset through
    /proc/self/clear_refs), per pixel: at most MAX_BYTES_PER_PIXEL (the docs' and the server's memory statement)."""

    image, save = _large(mode, 3000)
    path = tmp_path / f"large.{fmt.lower()}"
    image.save(path, format=fmt, **save)
    repo = Path(__file__).resolve().parents[1]
    ran = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(path)], cwd=repo, capture_output=True, text=True,
                         env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    per_pixel = float(ran.stdout.strip())
    print(f"{mode} {fmt}: {per_pixel:.1f} bytes per pixel")
    assert 1 < per_pixel <= MAX_BYTES_PER_PIXEL
