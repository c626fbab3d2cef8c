"""`etmlx bench vision`: a vision-language program's image cost, decode speed and memory, on random weights.

Shapes (benchmarks/vision_checkpoints.py builds them, LLaVA 1.5's layout): "0.5b" (default), a CLIP-style tower
at 448x448 (patch 14: 1,024 image tokens; 768 wide, 12 layers) before a 24-layer, 896-wide Llama decoder
(vocabulary 32k), ~0.5B parameters in float32; "tiny" (the test's: the same image size, a few layers).

Measured in one run, baselines included:
- image + first token: from one RGB 448x448 image and a question to the first token. etmlx: the prompt, the
  checkpoint's image processor, the program's vision method, the prefill; transformers (PyTorch eager, its
  default attention): the processor, then generate(max_new_tokens=1). Median over `repeats`, each repeat a new
  image (nothing reused); then etmlx again with the same image (the encoded image and the prompt cache reused).
- decode tokens/s: the VLM program's steps after an image prompt vs the same decoder weights exported text-only
  (a LlamaForCausalLM holding the language model's weights), with a text prompt of the same length.
- peak RSS: a fresh process loads the VLM program and answers one question about an image (VmHWM), against the
  program's weights (its .pte size); it starts with the malloc the `etmlx` command runs with (mimalloc where
  installed: runtime/allocator.py), which it reports.

    python -m benchmarks.vision rss PTE   (the child: prints one JSON line)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "0.5b": dict(vocab=32000, text=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                                        initializer_range=0.02),
                 vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                             image_size=448, patch_size=14, initializer_range=0.02)),
    "tiny": dict(vocab=128, text={}, vision=dict(image_size=448, patch_size=56)),
}
QUESTION = "t5 t17 t99 t3"
DECODE_STEPS = 32


def _image(seed: int, size: int = 448):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))


def _messages(image):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]


def _programs(shape: str, cache_dir: Path, say) -> tuple[Path, Path, Path]:
    """(checkpoint, VLM program, text-only program), built once per shape under cache_dir."""
    import torch
    import transformers as T

    from backends.mlx.llm.decoder.from_checkpoint import export_checkpoint
    from benchmarks.vision_checkpoints import build_llava

    spec = SHAPES[shape]
    root = Path(cache_dir) / f"vision-{shape}"
    checkpoint, vlm, text = root / "checkpoint", root / "vlm.pte", root / "text.pte"
    tokens = (spec["vision"]["image_size"] // spec["vision"]["patch_size"]) ** 2
    max_seq_len = tokens + 64 + DECODE_STEPS
    if not (checkpoint / "config.json").is_file():
        say(f"building the {shape} checkpoint")
        build_llava(checkpoint, spec["vocab"], spec["text"], spec["vision"], seed=0)
    if not vlm.is_file():
        say("exporting the vision-language program")
        export_checkpoint(checkpoint, vlm, max_seq_len=max_seq_len, verify=False, sampler="none")
    if not text.is_file():
        say("exporting its decoder alone")
        model = T.AutoModelForImageTextToText.from_pretrained(str(checkpoint))
        lm = T.LlamaForCausalLM(model.config.text_config)
        weights = {k.replace("model.language_model.", "model."): v for k, v in model.state_dict().items()
                   if k.startswith(("model.language_model.", "lm_head."))}
        lm.load_state_dict(weights)
        del model
        from backends.mlx.llm.decoder.export import export_decoder

        with torch.no_grad():
            export_decoder(lm.eval(), text, max_seq_len, verify=False)
    return checkpoint, vlm, text


def _first_token_etmlx(decoder, image) -> tuple[float, int]:
    """(seconds from the image to the first token, the token)."""
    from backends.mlx.llm.decoder.image_prompt import image_chat_prompt

    start = time.perf_counter()
    ids, images = image_chat_prompt(decoder.tokenizer, decoder.meta, _messages(image))
    token = [step.token for step in decoder.stream(ids, 1, images=images, reuse=True)][0]
    return time.perf_counter() - start, token


def _first_token_transformers(model, processor, image) -> tuple[float, int]:
    import torch

    start = time.perf_counter()
    text = processor.apply_chat_template(_messages(None), add_generation_prompt=True)
    inputs = processor(text=text, images=image, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=1, do_sample=False)
    return time.perf_counter() - start, int(out[0, -1])


def _decode_rate(decoder, ids, images=None) -> float:
    from backends.mlx.llm.decoder.text_generation import stream_text

    last = None
    for last in stream_text(decoder, ids, DECODE_STEPS, images=images):
        pass
    return last.generation_tps


def _peak_rss(pte: Path) -> dict:
    from backends.mlx.runtime.allocator import env_with_mimalloc

    ran = subprocess.run([sys.executable, "-m", "benchmarks.vision", "rss", str(pte)], capture_output=True, text=True,
                         env=env_with_mimalloc())
    if ran.returncode != 0:
        raise RuntimeError(f"the peak-RSS child failed: {ran.stderr.strip().splitlines()[-1:]}")
    return json.loads(ran.stdout.strip().splitlines()[-1])


def _peak_rss_cpp(pte: Path, ids: list[int], image) -> dict | None:
    """The same question answered by the C++ decode loop (etmlx_decode --image: no Python, no torch in the
    process): its peak RSS by GNU time (a child's wait4 figure would start from this process's); None where the
    program or the tool cannot (a build without image reading, a family etmlx_decode does not preprocess)."""
    import tempfile

    from backends.mlx.runtime.native_tools import tool_path
    from benchmarks.decode_memory import GNU_TIME

    try:
        tool = tool_path("etmlx_decode")
    except FileNotFoundError:
        return None
    if not GNU_TIME.is_file():
        return None
    with tempfile.TemporaryDirectory() as folder:
        png, rss = Path(folder) / "image.png", Path(folder) / "rss"
        image.save(png)
        ran = subprocess.run([str(GNU_TIME), "-f", "%M", "-o", str(rss), str(tool), str(pte), "--prompt-ids",
                              ",".join(map(str, ids)), "--image", str(png), "--max-tokens", str(DECODE_STEPS),
                              "--json"], capture_output=True, text=True)
        if ran.returncode != 0:
            print(f"[bench vision] etmlx_decode --image: {ran.stderr.strip()[-300:]}", file=sys.stderr)
            return None
        return {"peak_rss_bytes": int(rss.read_text().split()[-1]) * 1024,
                "tokens": json.loads(ran.stdout.strip().splitlines()[-1])["tokens"]}


def main(json_path=None, shape: str = "0.5b", repeats: int = 3, cache_dir="out/bench") -> int:
    import torch
    import transformers as T

    from backends.mlx.llm.decoder.loop import Decoder

    if shape not in SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")

    def say(msg):
        print(f"[bench vision] {msg}", file=sys.stderr, flush=True)

    checkpoint, vlm_pte, text_pte = _programs(shape, Path(cache_dir), say)
    vlm = Decoder(vlm_pte)
    _first_token_etmlx(vlm, _image(100))  # loads the image processor and the vision method
    etmlx_runs = [_first_token_etmlx(vlm, _image(seed)) for seed in range(repeats)]
    again_s = [_first_token_etmlx(vlm, _image(0))[0] for _ in range(repeats)]
    encoder = vlm.images
    start = time.perf_counter()
    encoder.encode(_image(200))
    encode_s = time.perf_counter() - start
    model = T.AutoModelForImageTextToText.from_pretrained(str(checkpoint)).eval()
    processor = T.AutoProcessor.from_pretrained(str(checkpoint))
    _first_token_transformers(model, processor, _image(100))
    eager_runs = [_first_token_transformers(model, processor, _image(seed)) for seed in range(repeats)]
    etmlx_s, eager_s = [s for s, _ in etmlx_runs], [s for s, _ in eager_runs]
    del model

    from backends.mlx.llm.decoder.image_prompt import image_chat_prompt

    ids, images = image_chat_prompt(vlm.tokenizer, vlm.meta, _messages(_image(300)))
    vlm_rate = statistics.median(_decode_rate(vlm, ids, images) for _ in range(repeats))
    image_tokens = vlm.meta.image_tokens
    del vlm
    text = Decoder(text_pte)
    text_ids = [5 + (i % 100) for i in range(len(ids))]
    text_rate = statistics.median(_decode_rate(text, text_ids) for _ in range(repeats))
    del text
    rss = _peak_rss(vlm_pte)
    rss_cpp = _peak_rss_cpp(vlm_pte, *_rss_question(vlm_pte))
    weights = vlm_pte.stat().st_size
    record = {
        "shape": shape, "image_tokens": image_tokens, "prompt_tokens": len(ids), "repeats": repeats,
        "image_first_token_s": {"etmlx": statistics.median(etmlx_s), "transformers": statistics.median(eager_s),
                                "etmlx_same_image_again": statistics.median(again_s)},
        "etmlx_encode_s": encode_s,
        # greedy first tokens per image, both engines (random weights: near ties may differ at real shapes)
        "first_tokens": {"etmlx": [t for _, t in etmlx_runs], "transformers": [t for _, t in eager_runs]},
        "decode_tokens_per_s": {"vlm": vlm_rate, "text_only": text_rate},
        "peak_rss_bytes": rss["peak_rss_bytes"], "weights_bytes": weights, "allocator": rss["allocator"],
        "peak_rss_bytes_cpp": rss_cpp["peak_rss_bytes"] if rss_cpp else None,
    }
    first = record["image_first_token_s"]
    print(f"image + first token ({shape}, one 448x448 image, {record['image_tokens']} image tokens, "
          f"{len(ids)}-token prompt; median of {repeats}):")
    print(f"  etmlx {first['etmlx'] * 1e3:.0f} ms (vision method alone {encode_s * 1e3:.0f} ms), transformers "
          f"{first['transformers'] * 1e3:.0f} ms: {first['etmlx'] / first['transformers']:.2f}x; the same image again "
          f"{first['etmlx_same_image_again'] * 1e3:.0f} ms")
    same = sum(a == b for a, b in zip(record["first_tokens"]["etmlx"], record["first_tokens"]["transformers"]))
    print(f"  first tokens equal transformers' for {same} of {repeats} images")
    print(f"decode: VLM program {vlm_rate:.1f} tok/s vs its decoder exported text-only {text_rate:.1f} tok/s "
          f"({vlm_rate / text_rate:.3f}x)")
    print(f"peak RSS {rss['peak_rss_bytes'] / 2**20:.0f} MiB vs weights {weights / 2**20:.0f} MiB "
          f"({rss['peak_rss_bytes'] / weights:.2f}x; Python API, malloc: {rss['allocator']})")
    if rss_cpp:
        print(f"peak RSS {rss_cpp['peak_rss_bytes'] / 2**20:.0f} MiB ({rss_cpp['peak_rss_bytes'] / weights:.2f}x) "
              f"answering the same question with etmlx_decode --image (C++, no torch)")
    else:
        print("peak RSS of etmlx_decode --image: not measured (no etmlx_decode with image reading, or no "
              "/usr/bin/time)")
    if json_path:
        Path(json_path).write_text(json.dumps(record, indent=2))
    return 0


def _rss_question(pte: Path) -> tuple[list[int], object]:
    """The peak-RSS measures' question: the prompt ids of a chat with one image, and the image."""
    from backends.mlx.llm.decoder.image_prompt import image_chat_prompt
    from backends.mlx.llm.decoder.meta import DecoderMeta
    from backends.mlx.llm.decoder.tokenizer_files import load_tokenizer

    meta = DecoderMeta.load(pte)
    ids, images = image_chat_prompt(load_tokenizer(pte, meta), meta, _messages(_image(0)))
    return ids, images[0]


def _rss_child(pte: str) -> None:
    from backends.mlx.llm.decoder.image_prompt import image_chat_prompt
    from backends.mlx.llm.decoder.loop import Decoder
    from benchmarks.decode_memory import _peak_rss_bytes

    decoder = Decoder(Path(pte))
    ids, images = image_chat_prompt(decoder.tokenizer, decoder.meta, _messages(_image(0)))
    for _ in decoder.stream(ids, DECODE_STEPS, images=images):
        pass
    from backends.mlx.runtime.allocator import active

    print(json.dumps({"peak_rss_bytes": _peak_rss_bytes(), "allocator": active()}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "rss":
        _rss_child(sys.argv[2])
    else:
        raise SystemExit("usage: python -m benchmarks.vision rss PTE")
