"""One image from a caller (a PIL image, a path, bytes or a `data:image/...;base64,` URL) to a plain RGB PIL image,
refusing hostile input with a one-line ImageInputError before it costs memory.

Accepted formats: PNG, JPEG, WebP, GIF and BMP (ALLOWED_FORMATS; an animated GIF or WebP gives its first frame).
Pillow only parses with those plugins, so a TIFF, HEIC, PSD, ... is refused by name without being parsed.
Checks, in order: the encoded size (ImageLimits.max_bytes; a data URL's before its base64 is decoded), the format,
the size the header declares (ImageLimits.max_pixels, before any pixel is decoded: a 20,000 x 20,000 PNG of a few
KiB is refused here), then the decode itself (corrupt or truncated data). Memory (MAX_BYTES_PER_PIXEL): loading
one image holds at most 12 bytes per pixel of its declared size (Pillow stores up to 4 per pixel; a conversion
holds the decoded image and its copy, and frees the decoded one at once), 192 MiB at the default 4096 x 4096; the
RGB result keeps 4 per pixel. Measured peak RSS growth (tests/test_image_input.py): plain RGB PNG 4.1 bytes per
pixel, rotated JPEG or CMYK 8.3, 16-bit grey 8.2, RGBA, grey with alpha or a palette with transparency 9.2.

Normalised as transformers' image processors do: EXIF orientation applied (a phone photo stands up as shown),
transparency (an alpha band or a palette's transparent colour) composited onto white, palette / grey / CMYK
converted to RGB, 16-bit grey scaled to 8 bits (Pillow's plain conversion would clip it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
ORIENTATION = 0x0112  # the EXIF tag
MAX_BYTES_PER_PIXEL = 12  # memory while loading one image, per declared pixel (see the docstring; measured <= 9.2)
ALLOWED_TEXT = "PNG, JPEG, WebP, GIF or BMP"
# Leading bytes of formats that are refused, so the message can name them (they are never parsed).
_KNOWN_OTHERS = [(b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"8BPS", "PSD"), (b"%PDF", "PDF"),
                 (b"\x00\x00\x01\x00", "ICO"), (b"\xff\x0a", "JPEG XL"), (b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
                 (b"<svg", "SVG"), (b"<?xml", "SVG/XML"), (b"qoif", "QOI")]
_FTYP_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF", b"msf1": "HEIF", b"avif": "AVIF",
                b"avis": "AVIF"}


class ImageInputError(ValueError):
    """An image that cannot be used; the message is one line naming the problem."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024  # encoded size of one image (a file, bytes, a data URL's payload)
    max_pixels: int = 4096 * 4096  # width x height the header declares; loading one takes at most 12 bytes each

    def check(self) -> None:
        for name in ("max_bytes", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ImageLimits.{name} must be an int >= 1, got {value!r}")


def _other_format(head: bytes) -> str | None:
    for magic, name in _KNOWN_OTHERS:
        if head.startswith(magic):
            return name
    if head[4:8] == b"ftyp":
        return _FTYP_BRANDS.get(head[8:12], "an ISO media file")
    return None


def _data_url_bytes(url: str, limits: ImageLimits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise ImageInputError("the data URL has no ',' before its data")
    media = header[len("data:"):].split(";")
    if not media[0].lower().startswith("image/"):
        raise ImageInputError(f"the data URL's media type is {media[0][:40]!r}, not image/...")
    if "base64" not in (p.strip().lower() for p in media[1:]):
        raise ImageInputError("the data URL is not base64 (data:image/...;base64,...)")
    payload = payload.strip()
    size = len(payload) // 4 * 3 - payload[-2:].count("=")  # the decoded size, known before decoding
    if size > limits.max_bytes:
        raise ImageInputError(f"the image is {size} bytes; at most {limits.max_bytes} are taken")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError("the data URL's base64 is invalid") from None


def _file_bytes(path: Path, limits: ImageLimits) -> bytes:
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ImageInputError(f"{path} is not a file")
        if size > limits.max_bytes:
            raise ImageInputError(f"{path} is {size} bytes; at most {limits.max_bytes} are taken")
        with open(path, "rb") as f:
            return f.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ImageInputError(f"cannot read {path}: {exc.strerror or exc}") from None


def source_bytes(source, limits: ImageLimits) -> bytes:
    """The encoded image a path, bytes or data URL names (sizes checked before reading / decoding)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, str) and source[:5].lower() == "data:":
        data = _data_url_bytes(source, limits)
    elif isinstance(source, (str, Path)):
        data = _file_bytes(Path(source), limits)
    else:
        raise ImageInputError(f"an image must be a PIL image, a path, bytes or a data: URL, not "
                              f"{type(source).__name__}")
    if len(data) > limits.max_bytes:
        raise ImageInputError(f"the image is {len(data)} bytes; at most {limits.max_bytes} are taken")
    if not data:
        raise ImageInputError("the image is empty (0 bytes)")
    return data


def _check_pixels(size: tuple[int, int], limits: ImageLimits) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ImageInputError(f"the image is {width} x {height} pixels: nothing to see")
    if width * height > limits.max_pixels:
        raise ImageInputError(f"the image is {width} x {height} pixels; at most {limits.max_pixels} pixels "
                              "are taken (a decompression bomb, or an image to scale down first)")


def _grey16_to_rgb(image: Image.Image) -> Image.Image:
    """16- or 32-bit grey (Pillow modes I;16*, I) to 8-bit RGB, scaling 0..65535 to 0..255 (rounded)."""
    values = np.asarray(image, dtype=np.uint32)  # one copy, worked on in place (the caller frees `image`)
    np.minimum(values, 65535, out=values)
    values *= 255
    values += 32767
    values //= 65535
    grey = values.astype(np.uint8)
    del values
    return Image.fromarray(grey).convert("RGB")


def _orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(ORIENTATION, 1))
    except Exception:  # noqa: BLE001 (unreadable EXIF: shown as stored, as viewers do)
        return 1


def to_rgb(image: Image.Image, owned: bool = False) -> Image.Image:
    """EXIF orientation applied, then RGB as transformers' convert_to_rgb: transparency (an alpha band or a
    palette's transparent colour) composited onto white. `owned`: `image` may be turned in place (an image this
    module decoded); a caller's image is never modified."""
    if _orientation(image) != 1:
        if owned:
            ImageOps.exif_transpose(image, in_place=True)
        else:
            image = ImageOps.exif_transpose(image)
    if image.mode.startswith("I;16") or image.mode == "I":
        return _grey16_to_rgb(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image if image.mode == "RGBA" else _converted(image, "RGBA", owned)
        # pasting through the alpha band onto white gives alpha_composite's pixels without its two RGBA copies
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        if owned:
            rgba.close()
        return out
    return image if image.mode == "RGB" else _converted(image, "RGB", owned)


def _converted(image: Image.Image, mode: str, owned: bool) -> Image.Image:
    """`image` in `mode`; an owned image's pixels are freed at once (close() drops them), not when it goes."""
    out = image.convert(mode)
    if owned:
        image.close()
    return out


def _decode(data: bytes, limits: ImageLimits) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.UnidentifiedImageError:
        other = _other_format(data[:64].lstrip()[:16])
        what = f"a {other} image" if other else "not an image Pillow recognises, or corrupt"
        raise ImageInputError(f"unsupported image: {what} (take {ALLOWED_TEXT})") from None
    except Image.DecompressionBombError as exc:  # Pillow's own check, far above ours: only its message has the size
        declared = re.search(r"\((\d+) pixels\)", str(exc))
        raise ImageInputError(f"the image declares {declared.group(1) if declared else 'too many'} pixels; at most "
                              f"{limits.max_pixels} are taken (a decompression bomb)") from None
    except Exception as exc:  # a header Pillow cannot parse: any error is the input's  # noqa: BLE001
        raise ImageInputError(f"the image's header is corrupt: {_one_line(exc)}") from None
    _check_pixels(image.size, limits)  # the declared size, before any pixel is decoded
    try:
        image.seek(0)  # an animation's first frame
        image.load()
        return to_rgb(image, owned=True)
    except MemoryError:
        raise ImageInputError("the image does not fit in memory") from None
    except Exception as exc:  # truncated or corrupt pixel data  # noqa: BLE001
        raise ImageInputError(f"the {image.format} image is corrupt or truncated: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]


def load_image(source, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """`source` (a PIL image, a str / Path file path, bytes, or a data:image/...;base64, URL) as an RGB image."""
    if isinstance(source, Image.Image):
        _check_pixels(source.size, limits)
        try:
            source.load()  # a lazily opened image decodes here, inside this error handling
            return to_rgb(source)
        except Exception as exc:  # noqa: BLE001 (a lazily loaded image may still fail to decode)
            raise ImageInputError(f"the image could not be converted to RGB: {_one_line(exc)}") from None
    return _decode(source_bytes(source, limits), limits)


def image_digest(image: Image.Image) -> str:
    """SHA-256 (hex) of the image's size and RGB pixels: the same picture from any source has the same digest
    (a prompt cache key part)."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    digest = hashlib.sha256(b"%dx%d;" % rgb.size)
    digest.update(rgb.tobytes())
    return digest.hexdigest()
