"""The C++ image-file reader (tools/etmlx_decode/image_file.cpp, behind `etmlx_decode --image FILE`) against the
Python reference `load_image` (llm/vision/images.py): the same RGB bytes for PNG and JPEG files of every kind
(made here with Pillow, or by hand where Pillow cannot write them), and hostile files refused in one line.

Runs the test program etmlx_image_read (built by `make setup`), which prints "W H\\n" and the RGB bytes."""

from __future__ import annotations

import io
import struct
import subprocess
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from backends.mlx.llm.vision.images import ImageInputError, ImageLimits, load_image
from backends.mlx.runtime.native_tools import tool_path

ORIENTATION = 0x0112
RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def tool() -> Path:
    try:
        return tool_path("etmlx_image_read")
    except FileNotFoundError as exc:  # not skipped: the checkout's build is incomplete
        pytest.fail(f"etmlx_image_read is not built ({exc})")


def _run(tool: Path, path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool), str(path), *args], capture_output=True, timeout=30)


def _cpp_pixels(tool: Path, path: Path, *args: str) -> np.ndarray:
    done = _run(tool, path, *args)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    header, _, pixels = done.stdout.partition(b"\n")
    width, height = map(int, header.split())
    assert len(pixels) == width * height * 3
    return np.frombuffer(pixels, np.uint8).reshape(height, width, 3)


def _assert_same(tool: Path, path: Path) -> None:
    want = np.asarray(load_image(path))
    got = _cpp_pixels(tool, path)
    assert got.shape == want.shape, (got.shape, want.shape)
    if not np.array_equal(got, want):
        diff = np.abs(got.astype(int) - want.astype(int))
        raise AssertionError(f"{path.name}: {np.count_nonzero(diff)} values differ, at most by {diff.max()}")


def _refused(tool: Path, path: Path, *words: str, args: tuple[str, ...] = ()) -> str:
    done = _run(tool, path, *args)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2, (done.returncode, err)
    assert done.stdout == b""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("etmlx_image_read: error: "), err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _saved(tmp_path: Path, name: str, image: Image.Image, fmt: str, **save) -> Path:
    path = tmp_path / name
    image.save(path, format=fmt, **save)
    return path


def _noise(shape, dtype=np.uint8, high=256) -> np.ndarray:
    return RNG.integers(0, high, shape, dtype=np.int64).astype(dtype)


# ---- PNG by hand (16-bit colour, low bit depths, tRNS colours, Adam7: what Pillow does not write) -----------

ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _packed_row(samples: np.ndarray, bit_depth: int) -> bytes:
    if bit_depth == 16:
        return samples.astype(">u2").tobytes()
    if bit_depth == 8:
        return samples.astype(np.uint8).tobytes()
    per_byte = 8 // bit_depth
    padded = np.zeros(-(-len(samples) // per_byte) * per_byte, np.uint16)
    padded[: len(samples)] = samples
    shifts = np.arange(per_byte - 1, -1, -1) * bit_depth
    return (padded.reshape(-1, per_byte) << shifts).sum(1).astype(np.uint8).tobytes()


def _png(samples: np.ndarray, bit_depth: int, colour_type: int, *, before: bytes = b"", after: bytes = b"",
         interlaced: bool = False) -> bytes:
    """A PNG of `samples` (H x W x channels), with chunks `before` the image data and `after` it."""
    height, width = samples.shape[:2]
    flat = samples.reshape(height, width, -1)
    raw = bytearray()
    for x0, y0, dx, dy in ADAM7 if interlaced else [(0, 0, 1, 1)]:
        for row in flat[y0::dy, x0::dx]:
            if row.size:
                raw += b"\0" + _packed_row(row.reshape(-1), bit_depth)
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, int(interlaced))
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + before + _chunk(b"IDAT", zlib.compress(bytes(raw)))
            + after + _chunk(b"IEND", b""))


def _written(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    return exif.tobytes()


# ---- the same pixels ---------------------------------------------------------------------------------------

def _pillow_pngs(tmp_path: Path) -> list[Path]:
    rgb = _noise((23, 37, 3))
    rgba = _noise((23, 37, 4))
    rgba[0, :, 3] = 0  # fully transparent and fully opaque rows beside the random alpha
    rgba[1, :, 3] = 255
    palette = Image.fromarray(_noise((23, 37), high=200)).convert("P")
    palette.putpalette(_noise(200 * 3).tolist())
    single = palette.copy()
    grey16 = Image.fromarray(_noise((23, 37), np.uint16, 65536))
    grey16.putpixel((0, 0), 65535)
    grey16.putpixel((1, 0), 0)
    return [
        _saved(tmp_path, "rgb.png", Image.fromarray(rgb), "PNG"),
        _saved(tmp_path, "rgba.png", Image.fromarray(rgba), "PNG"),
        _saved(tmp_path, "palette_trns.png", palette, "PNG", transparency=bytes(_noise(150).tolist())),
        _saved(tmp_path, "palette_one_clear.png", single, "PNG", transparency=3),
        _saved(tmp_path, "palette.png", palette, "PNG"),
        _saved(tmp_path, "grey.png", Image.fromarray(_noise((23, 37))), "PNG"),
        _saved(tmp_path, "grey_trns.png", Image.fromarray(_noise((23, 37), high=8)), "PNG", transparency=5),
        _saved(tmp_path, "grey_alpha.png", Image.fromarray(_noise((23, 37, 2))), "PNG"),
        _saved(tmp_path, "grey16.png", grey16, "PNG"),
        _saved(tmp_path, "bilevel.png", Image.fromarray(_noise((23, 37), bool, 2)), "PNG"),
        _saved(tmp_path, "exif6.png", Image.fromarray(rgb), "PNG", exif=_exif(6)),
    ]


def _hand_pngs(tmp_path: Path) -> list[Path]:
    rgb16 = _noise((23, 37, 3), np.uint16, 65536)
    rgb16_keyed = rgb16.copy()
    rgb16_keyed[2, :4] = [0x12AB, 0x3400, 0x56FF]  # high bytes 12 34 56: Pillow matches the key's low bytes
    rgb_keyed = _noise((23, 37, 3), high=4)  # few colours, so the tRNS colour occurs
    grey_alpha16 = _noise((23, 37, 2), np.uint16, 65536)
    palette = _noise(16 * 3).astype(np.uint8).tobytes()
    plte = _chunk(b"PLTE", palette)
    files = {
        "rgb16.png": _png(rgb16, 16, 2),
        "rgba16.png": _png(_noise((23, 37, 4), np.uint16, 65536), 16, 6),
        "grey_alpha16.png": _png(grey_alpha16, 16, 4),
        "grey16_trns.png": _png(_noise((23, 37), np.uint16, 65536), 16, 0, before=_chunk(b"tRNS", b"\x12\x34")),
        "rgb_trns.png": _png(rgb_keyed, 8, 2, before=_chunk(b"tRNS", struct.pack(">HHH", 1, 2, 3))),
        "rgb16_trns.png": _png(rgb16_keyed, 16, 2, before=_chunk(b"tRNS", struct.pack(">HHH", 0x112, 0x134, 0x156))),
        "palette4_trns.png": _png(_noise((23, 37), high=16), 4, 3,
                                  before=plte + _chunk(b"tRNS", bytes(_noise(9).tolist()))),
        "palette2.png": _png(_noise((23, 37), high=4), 2, 3, before=plte),
        "interlaced_rgb.png": _png(_noise((23, 37, 3)), 8, 2, interlaced=True),
        "interlaced_rgba16.png": _png(_noise((23, 37, 4), np.uint16, 65536), 16, 6, interlaced=True),
        "interlaced_palette4.png": _png(_noise((23, 37), high=16), 4, 3, before=plte, interlaced=True),
        "exif3_after_image.png": _png(_noise((23, 37, 3)), 8, 2, after=_chunk(b"eXIf", _exif(3)[6:])),
    }
    for depth in (1, 2, 4):
        grey = _noise((23, 37), high=1 << depth)
        top = (1 << depth) - 1
        files[f"grey{depth}.png"] = _png(grey, depth, 0)
        for key in (0, top):  # Pillow compares an L image's key unscaled: only 0 (and bilevel's 1) match
            files[f"grey{depth}_trns{key}.png"] = _png(grey, depth, 0, before=_chunk(b"tRNS", struct.pack(">H", key)))
    return [_written(tmp_path, name, data) for name, data in files.items()]


def _jpegs(tmp_path: Path) -> list[Path]:
    # smooth content plus noise: JPEG's DCT and upsampling do real work on it
    y, x = np.mgrid[0:23, 0:37]
    smooth = np.stack([x * 6, y * 10, (x + y) * 4], -1)
    rgb = Image.fromarray(np.clip(smooth + _noise((23, 37, 3), high=60), 0, 255).astype(np.uint8))
    cmyk = Image.frombytes("CMYK", (37, 23), _noise((23, 37, 4)).tobytes())
    return [
        _saved(tmp_path, "baseline.jpg", rgb, "JPEG", quality=90),
        _saved(tmp_path, "progressive.jpg", rgb, "JPEG", quality=75, progressive=True),
        _saved(tmp_path, "s420.jpg", rgb, "JPEG", subsampling=2),
        _saved(tmp_path, "s422.jpg", rgb, "JPEG", subsampling=1),
        _saved(tmp_path, "s444.jpg", rgb, "JPEG", subsampling=0, quality=95),
        _saved(tmp_path, "grey.jpg", rgb.convert("L"), "JPEG"),
        _saved(tmp_path, "cmyk.jpg", cmyk, "JPEG"),
        _saved(tmp_path, "noise.jpg", Image.fromarray(_noise((23, 37, 3))), "JPEG", quality=50),
        _saved(tmp_path, "xmp8.jpg", rgb, "JPEG",
               xmp=b'<x:xmpmeta><rdf:Description tiff:Orientation="8"/></x:xmpmeta>'),
        *[_saved(tmp_path, f"exif{n}.jpg", rgb, "JPEG", exif=_exif(n)) for n in range(1, 9)],
        _saved(tmp_path, "exif_unusual9.jpg", rgb, "JPEG", exif=_exif(9)),
    ]


def test_png_pixels_equal_load_image(tool, tmp_path):
    for path in _pillow_pngs(tmp_path) + _hand_pngs(tmp_path):
        _assert_same(tool, path)


def test_jpeg_pixels_equal_load_image(tool, tmp_path):
    # Exact: Pillow's bundled libjpeg-turbo and the system's (2.1.5) give the same ISLOW DCT and upsampling.
    for path in _jpegs(tmp_path):
        _assert_same(tool, path)


def test_exif_orientations_turn_the_image(tool, tmp_path):
    paths = {p.name: p for p in _jpegs(tmp_path)}
    upright = _cpp_pixels(tool, paths["exif1.jpg"])
    assert _cpp_pixels(tool, paths["exif6.jpg"]).shape == (37, 23, 3)  # 6 and 8 stand the 37 x 23 image up
    assert np.array_equal(_cpp_pixels(tool, paths["exif3.jpg"]), upright[::-1, ::-1])


def test_control_the_comparison_can_fail(tool, tmp_path):
    """The plain decode of a rotated JPEG (orientation not applied) is a different picture: the equality above is
    not vacuous, and the C++ reader does turn it."""
    path = _saved(tmp_path, "exif3.jpg", Image.fromarray(_noise((23, 37, 3))), "JPEG", exif=_exif(3))
    plain = np.asarray(Image.open(path).convert("RGB"))
    got = _cpp_pixels(tool, path)
    assert got.shape == plain.shape and not np.array_equal(got, plain)
    assert np.array_equal(got, np.asarray(load_image(path)))


def test_limits(tool, tmp_path):
    path = _saved(tmp_path, "rgb.png", Image.fromarray(_noise((23, 37, 3))), "PNG")
    assert _cpp_pixels(tool, path, "--max-pixels", str(37 * 23)).shape == (23, 37, 3)
    _refused(tool, path, "37 x 23 pixels", "at most 850 pixels", args=("--max-pixels", "850"))
    size = path.stat().st_size
    assert _cpp_pixels(tool, path, "--max-bytes", str(size)).shape == (23, 37, 3)
    _refused(tool, path, f"{size} bytes", f"at most {size - 1}", args=("--max-bytes", str(size - 1)))
    _refused(tool, path, "--max-pixels", args=("--max-pixels", "0"))


def _python_refuses(path: Path, limits: ImageLimits = ImageLimits()) -> None:
    with pytest.raises(ImageInputError):
        load_image(path, limits)


def test_decompression_bombs_refused_before_decoding(tool, tmp_path):
    # A 20,000 x 20,000 PNG of a few hundred bytes: one zero row of image data behind an IHDR declaring it all.
    ihdr = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    bomb = (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(bytes(60001)))
            + _chunk(b"IEND", b""))
    png = _written(tmp_path, "bomb.png", bomb)
    # A JPEG whose frame header says 20,000 x 20,000.
    small = io.BytesIO()
    Image.fromarray(_noise((8, 8, 3))).save(small, "JPEG")
    data = bytearray(small.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", 20000, 20000)
    jpeg = _written(tmp_path, "bomb.jpg", bytes(data))
    for path in (png, jpeg):
        start = time.monotonic()
        _refused(tool, path, "20000 x 20000 pixels", "at most 16777216 pixels")
        assert time.monotonic() - start < 2
        _python_refuses(path)


def test_bad_files_refused_in_one_line(tool, tmp_path):
    png = io.BytesIO()
    Image.fromarray(_noise((23, 37, 3))).save(png, "PNG")
    jpeg = io.BytesIO()
    Image.fromarray(_noise((23, 37, 3))).save(jpeg, "JPEG")
    bad_idat_data = bytearray(png.getvalue())
    bad_idat_data[bad_idat_data.index(b"IDAT") + 10] ^= 0xFF
    bad_ihdr_crc = bytearray(png.getvalue())
    bad_ihdr_crc[29] ^= 1
    cases = {
        "truncated.png": (png.getvalue()[: len(png.getvalue()) // 2], ["PNG", "corrupt or truncated"]),
        "truncated.jpg": (jpeg.getvalue()[: len(jpeg.getvalue()) // 2], ["JPEG", "corrupt or truncated"]),
        "no_eoi.jpg": (jpeg.getvalue()[:-2], ["JPEG", "corrupt or truncated"]),
        "bad_idat.png": (bytes(bad_idat_data), ["PNG", "corrupt"]),
        "bad_ihdr_crc.png": (bytes(bad_ihdr_crc), ["PNG", "IHDR"]),
        "header_only.png": (png.getvalue()[:33], ["PNG", "corrupt or truncated"]),
        "random.bin": (bytes(_noise(500).tolist()), ["not an image etmlx_decode reads"]),
        "empty.png": (b"", ["empty (0 bytes)"]),
        "image.tif": (b"II*\x00" + bytes(200), ["a TIFF image", "reads PNG and JPEG"]),
        "image.heic": (b"\x00\x00\x00\x18ftypheic" + bytes(40), ["a HEIC image"]),
        "image.pdf": (b"  \n%PDF-1.4" + bytes(40), ["a PDF image"]),
    }
    for name, (data, words) in cases.items():
        path = _written(tmp_path, name, data)
        line = _refused(tool, path, name, *words)
        assert "Traceback" not in line and "abort" not in line.lower()
        _python_refuses(path)
    _refused(tool, tmp_path / "missing.png", "cannot read", "missing.png", "No such file")
    _refused(tool, tmp_path, "is not a file")
    gif = _saved(tmp_path, "image.gif", Image.fromarray(_noise((5, 5, 3))), "GIF")
    _refused(tool, gif, "image.gif is a GIF image; etmlx_decode reads PNG and JPEG (convert it, or use "
                        "`etmlx generate`)")
    for fmt, name in (("WEBP", "a WebP image"), ("BMP", "a BMP image")):
        _refused(tool, _saved(tmp_path, f"image.{fmt.lower()}", Image.fromarray(_noise((5, 5, 3))), fmt), name)


def test_cut_files_read_exactly_when_python_reads_them(tool, tmp_path):
    """A file cut anywhere is read by both readers (the same pixels) or refused by both (the C++ one in one line):
    Pillow reads a PNG cut after its last row (in the image data's Adler-32, its CRC or IEND) and a JPEG cut
    after its last row is decoded, and refuses one cut earlier."""
    rgb = Image.fromarray(_noise((9, 11, 3)))
    files = {"interlaced.png": _png(_noise((9, 11, 4)), 8, 6, interlaced=True)}
    for fmt, name, save in (("PNG", "plain.png", {}), ("JPEG", "baseline.jpg", {}),
                            ("JPEG", "progressive.jpg", {"progressive": True})):
        data = io.BytesIO()
        rgb.save(data, fmt, **save)
        files[name] = data.getvalue()
    for name, data in files.items():
        for cut in sorted({*range(1, len(data), max(1, len(data) // 50)), *range(len(data) - 30, len(data))}):
            path = _written(tmp_path, f"cut{cut}_{name}", data[:cut])
            try:
                load_image(path)
                python_reads = True
            except ImageInputError:
                python_reads = False
            if python_reads:
                _assert_same(tool, path)
            else:
                _refused(tool, path, name)


def test_png_checksums_as_pillow(tool, tmp_path):
    """Pillow skips the image data's CRC but not the zlib stream's Adler-32, nor the CRC of a chunk before it."""
    data = _png(_noise((9, 11, 3)), 8, 2)
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4:idat])[0]
    bad_crc = bytearray(data)
    bad_crc[idat + 4 + length] ^= 1
    _assert_same(tool, _written(tmp_path, "bad_idat_crc.png", bytes(bad_crc)))
    bad_adler = bytearray(data)
    bad_adler[idat + 4 + length - 1] ^= 1
    path = _written(tmp_path, "bad_adler.png", bytes(bad_adler))
    _refused(tool, path, "corrupt")
    _python_refuses(path)
    bad_text = data[:33] + _chunk(b"tEXt", b"a\0b")[:-1] + b"\0" + data[33:]
    path = _written(tmp_path, "bad_text_crc.png", bad_text)
    _refused(tool, path, "tEXt")
    _python_refuses(path)
