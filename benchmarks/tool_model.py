"""A tiny random decoder for tool calling, with no download: the tiny BPE tokenizer (tiny_model.py) plus every
family's call markers as added tokens, and chat templates in each family's tool format (hermes, llama3_json,
mistral, generic), so that one exported program serves as a checkpoint of any family (`use_format`). What the
tool-calling tests and `etmlx bench tools` run against; its answers are noise, made to parse by the grammar.
"""

from __future__ import annotations

from pathlib import Path

from backends.mlx.llm.builtin.tiny_model import CHAT_TEMPLATE, tiny_llama, train_tokenizer

# Each family's template, reduced to what matters here: the tools in the prompt, earlier calls in the family's
# syntax, results in the family's role (the real templates: Qwen2.5, Llama 3.1, Mistral v3).
HERMES = (
    "{%- if tools %}<|system|>{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "<tools>{% for t in tools %}{{ t.function.name }}: {{ t.function.parameters | tojson }}\n{% endfor %}</tools>"
    "Call: <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call>\n"
    "{%- elif messages[0].role == 'system' %}<|system|>{{ messages[0].content }}\n{%- endif %}"
    "{%- for m in messages %}{% if m.role == 'system' %}"
    "{% elif m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}\n"
    "{% elif m.role == 'tool' %}<|tool|><tool_response>\n{{ m.content }}\n</tool_response>\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
LLAMA = (
    "{%- if tools %}<|start_header_id|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{{ t.function.parameters | tojson }}{% endfor %}\nAnswer {\"name\": name, \"parameters\": args}\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|assistant|><|python_tag|>"
    "{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"parameters\": "
    "{{ c.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}\n"
    "{% elif m.role == 'tool' %}<|ipython|>{{ m.content }}\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MISTRAL = (
    "{%- if tools %}[AVAILABLE_TOOLS]{% for t in tools %}{{ t.function.name }}{{ t.function.parameters | tojson }}"
    "{% endfor %}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]["
    "{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]\n"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA, "mistral": MISTRAL, "generic": CHAT_TEMPLATE}

def tool_tokenizer():
    """The tiny BPE tokenizer plus every family's markers as added tokens, with the hermes template."""
    tok = train_tokenizer()
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # Qwen's: added, not special
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "<|python_tag|>"]})
    tok.chat_template = HERMES
    return tok


def export_tool_model(out: Path, max_seq_len: int, batch: int = 4, hidden: int = 32, layers: int = 1) -> Path:
    """The tiny model with the mask input (constrained calls) and this tokenizer, exported to `out`; `hidden` and
    `layers` give it a real model's step cost (`etmlx bench tools --hidden 896 --layers 24`)."""
    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.sampler.config import SamplerConfig

    tok = tool_tokenizer()
    model = tiny_llama(len(tok), tok.eos_token_id, hidden=hidden, layers=layers)
    model.config.max_position_embeddings = max_seq_len  # the prompts hold the tools (RoPE positions are computed)
    export_decoder(model, Path(out), max_seq_len, batch=batch, tokenizer=tok,
                   config=SamplerConfig(top_k=True, logit_bias=4, allowed_mask=True))
    return Path(out)


def use_format(service, fmt: str) -> None:
    """Serve the program as a checkpoint of family `fmt`: its template and its call syntax (one export serves
    all four: the tokenizer has every family's markers)."""
    service.meta.tool_call_format = fmt
    service.tokenizer.chat_template = TEMPLATES[fmt]
    if hasattr(service.tokenizer, "_template"):  # LightTokenizer compiles its template once
        service.tokenizer._template = None
