"""Images in requests: OpenAI chat `image_url` content parts (and LMTP GENERATE's "images") to checked RGB images.

A chat message's content may be a list of parts: {"type": "text", "text": ...} and {"type": "image_url",
"image_url": {"url": URL, "detail": "auto" | "low" | "high"}} (detail is accepted and changes nothing: the
checkpoint's processor decides the resolution). URLs:
- `data:image/...;base64,...`: always;
- `file:///abs/path` or a plain path: only under `etmlx serve --allow-local-images DIR`, and only a file inside DIR
  (symbolic links resolved first; a relative path is relative to DIR);
- http(s) and anything else: refused: this server fetches nothing remote.

Each image part becomes {"type": "image"} (the transformers chat-template convention) and its image joins the
request's `images`, in prompt order. Checks on the event loop are cheap (shapes, the count, the URL scheme); reading
and decoding (llm/vision/images.py: formats, sizes, corrupt data) run in worker threads, at most `decoders` images at
once, so the server's memory for decoding stays under decoders x 12 x max_pixels bytes (images.py's
MAX_BYTES_PER_PIXEL; 384 MiB by default) and /health and
other streams keep going. Each problem is one ApiError (HTTP 400) naming the part.
"""

from __future__ import annotations

import asyncio
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from backends.mlx.llm.vision.images import ImageInputError, ImageLimits, load_image
from backends.mlx.serve.api_errors import ApiError

DEFAULT_MAX_IMAGES = 8
DETAILS = ("auto", "low", "high")


@dataclass
class ImageInputs:
    """What a server takes: whether its program takes images at all, how many per request, from where."""
    takes_images: bool = False
    max_images: int = DEFAULT_MAX_IMAGES  # per request
    local_dir: Path | None = None  # --allow-local-images DIR (resolved); None: no local files
    limits: ImageLimits = field(default_factory=ImageLimits)
    decoders: int = 2  # images decoded at once, over all requests
    _gate: asyncio.Semaphore | None = field(default=None, repr=False)

    def body_bytes(self) -> int:
        """The most a request's images add to its body (base64: 4 bytes per 3, plus the part's JSON)."""
        return self.max_images * (self.limits.max_bytes * 4 // 3 + 1024) if self.takes_images else 0

    def check_count(self, count: int, model_name: str) -> None:
        if count and not self.takes_images:
            raise ApiError(f"the model '{model_name}' takes no images (a text-only program): send text only",
                           param="messages")
        if count > self.max_images:
            raise ApiError(f"the request has {count} images; this server takes at most {self.max_images} per "
                           "request (etmlx serve --max-images)", param="messages")

    async def decode(self, sources: list[tuple[str, object]]) -> list:
        """The images of `sources` ((where, URL) pairs), decoded off the event loop; an ApiError names the first
        bad one."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.decoders)
        images = []
        for where, url in sources:
            async with self._gate:
                images.append(await asyncio.to_thread(self._load, where, url))
        return images

    def _load(self, where: str, url):
        try:
            return load_image(self._source(where, url), self.limits)
        except ImageInputError as exc:
            raise ApiError(f"{where}: {exc}", param="messages") from None

    def _source(self, where: str, url: str):
        """A data URL as it is; a local file's checked path."""
        scheme = url.split(":", 1)[0].lower() if ":" in url[:12] else ""
        if scheme == "data":
            return url
        if scheme in ("http", "https", "ftp"):
            raise ApiError(f"{where}: remote image URLs are not fetched: send the image as a data:image/...;base64, "
                           "URL", param="messages")
        if scheme not in ("", "file"):
            raise ApiError(f"{where}: image URLs must be data: URLs (or local files where the server allows them), "
                           f"not {scheme}:", param="messages")
        if self.local_dir is None:
            raise ApiError(f"{where}: local image files are off: send a data: URL, or start the server with "
                           "--allow-local-images DIR", param="messages")
        return self._local_path(where, url)

    def _local_path(self, where: str, url: str) -> Path:
        if url.lower().startswith("file:"):
            parsed = urllib.parse.urlparse(url)
            if parsed.netloc not in ("", "localhost"):
                raise ApiError(f"{where}: file URLs must name a local file (file:///path)", param="messages")
            path = Path(urllib.request.url2pathname(parsed.path))
        else:
            path = Path(url)
        try:
            resolved = (self.local_dir / path).resolve(strict=True)  # an absolute path replaces local_dir
        except (OSError, RuntimeError):
            raise ApiError(f"{where}: no such image file under the allowed directory", param="messages") from None
        if not resolved.is_relative_to(self.local_dir):
            raise ApiError(f"{where}: the file is outside the directory this server allows images from",
                           param="messages")
        return resolved


def _image_url(part: dict, where: str) -> str:
    spec = part.get("image_url")
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str) or not spec["url"]:
        raise ApiError(f"{where}.image_url must be an object with a string 'url'", param="messages")
    unknown = sorted(set(spec) - {"url", "detail"})
    if unknown:
        raise ApiError(f"{where}.image_url has unknown field '{unknown[0]}' (url, detail)", param="messages")
    if spec.get("detail") is not None and spec["detail"] not in DETAILS:
        raise ApiError(f"{where}.image_url.detail must be one of {', '.join(DETAILS)}", param="messages")
    return spec["url"]


def image_parts(messages) -> tuple[object, list[tuple[str, str]]]:
    """`messages` with each image_url part replaced by {"type": "image"}, and the (where, URL) of each image in
    order. Anything that is not a list of message objects is left for the prompt's own checks."""
    if not isinstance(messages, list):
        return messages, []
    sources, out = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "image_url"
                                                    for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                where = f"messages[{i}].content[{j}]"
                sources.append((where, _image_url(part, where)))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, sources


def generate_sources(value) -> list[tuple[str, str]]:
    """LMTP GENERATE's "images": a list of URLs (as image_url's url) to (where, URL) pairs."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(u, str) and u for u in value):
        raise ApiError("'images' must be a list of image URLs (data:image/...;base64,...)", param="images")
    return [(f"images[{k}]", url) for k, url in enumerate(value)]
