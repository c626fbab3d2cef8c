"""A vision-language program's images to the decoder's image embeddings, and the prompt cache's key for them.

    encoder = ImageEncoder(pte, meta)
    keyed, images = encoder.prompt(prompt_ids, [pil_image, ...])
    Decoder.stream(...): Sequence(prompt=keyed, images=images)

Pixels come from the checkpoint's image processor (its config travels in the program, PROCESSOR_PREFIX), then
the program's vision method ([1, C, H, W] -> [1, T, D]), one call per tile; LLaVA-NeXT's and LLaVA-OneVision's
tiles' features are then packed on the host (anyres.py). Encoded images are kept by content (a digest of the
pixels; for LLaVA-OneVision, whose image among others is one tile, with the layout too), so a second question about
the same image does not encode it again.

The prompt cache (runtime/decode_rows.h) matches token ids; every image's positions carry the same image token, so
two images would look alike to it. `prompt` therefore returns the ids with each image position replaced by a key
>= the vocabulary, drawn from the image's digest and the position within the image: a cached prefix is reused only
where the same image sat. DecodeRows.call_inputs turns keys back into the image token before a call.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.mlx.llm.decoder import anyres, mistral3_vision
from backends.mlx.llm.decoder.meta import PROCESSOR_PREFIX, DecoderMeta
from backends.mlx.llm.decoder.qwen2_vl import fixed_size_pixels
from backends.mlx.llm.vision.images import image_digest
from backends.mlx.llm.vision.preprocess import files_config, preprocess
from backends.mlx.runtime.pte_metadata import named_data
from backends.mlx.runtime.runner import load_method

KEY_SPACE = 1 << 52  # keys: vocab + [0, KEY_SPACE), exact in int64 and in a float64 (ctypes, JSON)
ENCODED_KEPT = 16  # images whose embeddings are kept (~T * D * 4 bytes each)


@dataclass
class PromptImages:
    """A request's image positions in its prompt and the embedding at each."""

    positions: torch.Tensor  # [n] int64
    embeds: torch.Tensor  # [n, D] float32

    def fill(self, out: torch.Tensor, row: int, start: int) -> None:
        """Write the embeddings of positions start .. start + out.shape[1] - 1 into out[row] ([B, L, D])."""
        columns = self.positions - start
        inside = (columns >= 0) & (columns < out.shape[1])
        out[row, columns[inside]] = self.embeds[inside]


def plain_ids(meta: DecoderMeta, ids: list[int]) -> list[int]:
    """`ids` with image keys turned back into the image token (what the program is fed)."""
    return [meta.image_token_id if t >= meta.vocab_size else t for t in ids]


def pixel_inputs(images: list, processor: dict, prompt_images: int | None = None) -> torch.Tensor:
    """[N, C, H, W] float32 pixel values as the checkpoint's image processor makes them (llm/vision/preprocess.py)
    for `images` of a prompt holding `prompt_images` images (default: these)."""
    return torch.from_numpy(preprocess(images, processor, prompt_images).pixel_values).float()


def processor_in(pte: Path) -> dict:
    """The image processor's configuration stored in the program (vision_export.PROCESSOR_FILES)."""
    blobs = named_data(pte, prefix=PROCESSOR_PREFIX)
    config = files_config({name[len(PROCESSOR_PREFIX):]: data for name, data in blobs.items()})
    if config is None:
        raise ValueError(f"{pte} carries no image processor config: re-export it")
    return config


class ImageEncoder:
    """Not thread-safe: a caller on several threads holds `lock` around `prompt` / `encode`."""

    def __init__(self, pte: Path, meta: DecoderMeta):
        self.pte, self.meta = Path(pte), meta
        self.lock = threading.Lock()
        self.method = load_method(self.pte, meta.vision_method)
        self._processor = None
        self._anyres = anyres.parse(meta.image_prompt)  # (family, prompt) or None
        self._rows = mistral3_vision.parse(meta.image_prompt)
        self._newline = None
        self._kept: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoded = 0  # images run through the vision method (not found among the kept ones)

    def encode(self, image, prompt_images: int = 1) -> tuple[str, torch.Tensor]:
        """(digest, embeddings [T, D]) of one RGB PIL image of a prompt with `prompt_images` images."""
        digest = image_digest(image)
        if self._anyres is not None and not self._anyres[0].tiled(prompt_images):  # one tile: other embeddings, other key
            digest = hashlib.sha256(f"{digest};one tile".encode()).hexdigest()
        if digest in self._kept:
            self._kept.move_to_end(digest)
            return digest, self._kept[digest]
        if self._processor is None:
            self._processor = processor_in(self.pte)
        if len(self.meta.image_size) == 2:  # flattened patches (Qwen2-VL): at the program's one grid
            pixels = fixed_size_pixels(image, self._processor, self.meta.image_size)
        elif self._rows is not None:  # Mistral 3: at the program's one size
            pixels = mistral3_vision.program_pixels(image, self._processor, self.meta.image_size[-1])
        else:
            pixels = pixel_inputs([image], self._processor, prompt_images)
        size = list(self.meta.image_size)
        if list(pixels.shape[-len(size):]) != size:
            raise ValueError(f"the image processor made pixels {list(pixels.shape[-len(size):])}, the vision method takes "
                             f"{self.meta.image_size}")
        # one call per tile (a tiled family's image is several, tile_prompt.py; others' one), in prompt order
        tiles = pixels.reshape(-1, *size)
        if self._anyres is not None:
            family, prompt = self._anyres
            embeds = self.anyres(tiles[:family.tiles(prompt, image.height, image.width, prompt_images)],
                                 (image.height, image.width), prompt_images)
        else:
            embeds = torch.cat(self._tile_features(tiles))
        self.encoded += 1
        self._kept[digest] = embeds
        if len(self._kept) > ENCODED_KEPT:
            self._kept.popitem(last=False)
        return digest, embeds

    def anyres(self, tiles: torch.Tensor, size: tuple[int, int], prompt_images: int = 1) -> torch.Tensor:
        """An anyres image's embeddings [L, D]: its tiles [1 + grid, C, S, S] (or one) encoded, packed for an image
        of `size` (height, width) in a prompt with `prompt_images` images."""
        family, prompt = self._anyres
        if self._newline is None:
            blob = named_data(self.pte, [family.NEWLINE_KEY]).get(family.NEWLINE_KEY)
            if blob is None:
                raise ValueError(f"{self.pte} carries no {prompt['kind']} image_newline: re-export it")
            self._newline = family.newline_from(blob)
        return family.pack(torch.stack(self._tile_features(tiles)), size, prompt, self._newline, prompt_images)

    def _tile_features(self, tiles: torch.Tensor) -> list[torch.Tensor]:
        """The vision method's features [T, D] of each tile [C, S, S] (or patches), one call each."""
        return [self.method.execute([tile[None].contiguous()])[0][0].float() for tile in tiles]

    def prompt(self, ids: list[int], images: list) -> tuple[list[int], PromptImages]:
        """(ids keyed by image content for the prompt cache, the images' positions and embeddings)."""
        meta = self.meta
        positions = [i for i, t in enumerate(ids) if t == meta.image_token_id]
        if not meta.image_prompt and len(positions) != len(images) * meta.image_tokens:
            raise ValueError(f"the prompt has {len(positions)} image positions; {len(images)} image(s) take "
                             f"{len(images) * meta.image_tokens}")
        encoded = [self.encode(image, len(images)) for image in images]
        taken = sum(len(embeds) for _, embeds in encoded)
        if len(positions) != taken:  # a tiled family's: the images' tiles decide
            raise ValueError(f"the prompt has {len(positions)} image positions; {len(images)} image(s) take {taken}")
        keyed, vectors, at = list(ids), [], 0
        for digest, embeds in encoded:
            base = int(digest[:16], 16)
            for k in range(len(embeds)):
                keyed[positions[at]] = meta.vocab_size + (base + k) % KEY_SPACE
                at += 1
            vectors.append(embeds)
        embeds = torch.cat(vectors) if vectors else torch.zeros(0, meta.image_embed_dim)
        return keyed, PromptImages(torch.tensor(positions, dtype=torch.int64), embeds)
