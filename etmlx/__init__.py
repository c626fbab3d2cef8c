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

__all__ = ["__version__", "generate", "load", "load_prompt_cache", "make_prompt_cache", "save_prompt_cache",
           "stream_generate"]


def __getattr__(name: str):
    if name in ("load", "generate", "stream_generate", "make_prompt_cache", "save_prompt_cache", "load_prompt_cache"):
        from etmlx import api

        return getattr(api, name)
    raise AttributeError(f"module 'etmlx' has no attribute {name!r}")
