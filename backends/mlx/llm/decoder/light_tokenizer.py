"""A tokenizer directory loaded without transformers, for the decode and serve paths.

Importing transformers and building an AutoTokenizer costs ~1.5 s, as much as the rest of
`etmlx generate`'s start. A directory whose tokenizer_config.json names the plain tokenizer.json
classes (PreTrainedTokenizerFast, or TokenizersBackend as transformers 5 saves it) is fully described
by tokenizer.json (the `tokenizers` library runs it, post-processor included) plus its special tokens
and chat template, so those load here. Any other class may add its own rules in Python (e.g. a
config's add_bos_token rebuilding the post-processor), so it goes to AutoTokenizer, as does anything
unexpected in the config. tests/test_text_api.py checks both give the same ids, text and chat prompts.

Only what the decode and serve paths call is provided: encode, decode, __call__, apply_chat_template
(rendered the way transformers renders it), bos_token / eos_token (and their ids), chat_template.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

PLAIN_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# config keys that make transformers change the tokenizer.json behaviour
_REWRITING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "from_slow")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value


class LightTokenizer:
    def __init__(self, tokenizer, config: dict, chat_template: str | None):
        self._tok = tokenizer
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map = {name: _token_text(config[name]) for name in _SPECIAL if config.get(name)}
        for name in _SPECIAL:
            setattr(self, name, self.special_tokens_map.get(name))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._template = None

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean:  # transformers' clean_up_tokenization
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                                  (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True, **kwargs):
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        values = {"tools": None, "documents": None, **self.special_tokens_map, **kwargs}  # tools: the template's own
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **values)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _compile(source: str):
    """The template in an environment configured as transformers configures its own (sandboxed,
    trim_blocks, lstrip_blocks, loop controls, its tojson, raise_exception and strftime_now)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_light(path: Path) -> LightTokenizer | None:
    """The directory as a LightTokenizer, or None when it needs transformers (see the module doc)."""
    path = Path(path)
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(config, dict) or config.get("tokenizer_class") not in PLAIN_CLASSES
            or any(key in config for key in _REWRITING_KEYS) or not (path / "tokenizer.json").is_file()):
        return None
    template = config.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if template is not None and not isinstance(template, str):
        return None  # named templates: transformers picks one
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_truncation()  # transformers ignores these settings unless a call asks for them
    tokenizer.no_padding()
    return LightTokenizer(tokenizer, config, template)


def load_tokenizer(path: Path):
    """The tokenizer saved in directory `path`: light when it can be, else transformers' AutoTokenizer."""
    light = load_light(path)
    if light is not None:
        return light
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
