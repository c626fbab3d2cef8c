"""etmlx: exported PyTorch language models run by ExecuTorch on MLX, sampling on the device.

    from etmlx import load, generate, stream_generate

    model = load("model.pte")
    print(generate(model, "One morning, Mira went to", max_tokens=40))
    for response in stream_generate(model, [{"role": "user", "content": "Hi!"}], temperature=0.7, seed=1):
        print(response.text, end="", flush=True)

The names follow mlx-lm's (mlx_lm.load / generate / stream_generate). `import etmlx` stays light:
torch and the runtime load on first use of these functions.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("etmlx")  # pyproject.toml is the one home of the number
except PackageNotFoundError:
    __version__ = "unknown"

# The public names, each loaded on first use: name -> (implementing module, its name there).
_PUBLIC = {
    # text generation over an exported decoder (etmlx/api.py)
    **{name: ("etmlx.api", name) for name in ("load", "generate", "stream_generate", "make_prompt_cache",
                                               "save_prompt_cache", "load_prompt_cache")},
    # exporting: a checkpoint (as `etmlx export`), any nn.Module, a module wrapped in a sampler, a decoder
    "export": ("backends.mlx.llm.decoder.from_checkpoint", "export_checkpoint"),
    "export_program": ("backends.mlx.exporter.export", "export_to_pte"),
    "ExportResult": ("backends.mlx.exporter.export", "ExportResult"),
    "export_sampling_head": ("backends.mlx.llm.sampler.export", "export_sampling_head"),
    "sampler_inputs": ("backends.mlx.llm.sampler.export", "sampler_inputs"),
    "export_decoder": ("backends.mlx.llm.decoder.export", "export_decoder"),
    # sampling on the device
    "SamplingHead": ("backends.mlx.llm.sampler.head", "SamplingHead"),
    "GreedyHead": ("backends.mlx.llm.sampler.head", "GreedyHead"),
    "SeedSchedule": ("backends.mlx.llm.sampler.head", "SeedSchedule"),
    "SamplerConfig": ("backends.mlx.llm.sampler.config", "SamplerConfig"),
    "SamplingParams": ("backends.mlx.llm.sampler.params", "SamplingParams"),
    # decode loops
    "Decoder": ("backends.mlx.llm.decoder.loop", "Decoder"),
    "DraftModel": ("backends.mlx.llm.decoder.draft_model", "DraftModel"),
}

__all__ = ["__version__", *sorted(_PUBLIC)]


def __getattr__(name: str):
    if name in _PUBLIC:
        from importlib import import_module

        module, attribute = _PUBLIC[name]
        value = getattr(import_module(module), attribute)
        globals()[name] = value  # once
        return value
    raise AttributeError(f"module 'etmlx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
