"""Shared by the tool-calling tests: one tiny random decoder (allowed-token mask input, 4 rows) whose tokenizer
has each family's markers as added tokens, chat templates in each family's tool format, and test tools."""

from __future__ import annotations

from backends.mlx.llm.builtin.tiny_model import CHAT_TEMPLATE, train_tokenizer
from run_once import exclusive, shared_dir

MAX_SEQ_LEN = 1536
BATCH = 4

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

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers", "strict": True,
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]


def tool_tokenizer():
    """The tiny BPE tokenizer plus every family's markers as added tokens, with the hermes template."""
    tok = train_tokenizer()
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # Qwen's: added, not special
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "<|python_tag|>"]})
    tok.chat_template = HERMES
    return tok


def tool_pte(tmp_path_factory):
    """Exported once per run (other xdist workers wait on the lock)."""
    from backends.mlx.llm.builtin.tiny_model import tiny_llama
    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.sampler.config import SamplerConfig

    directory = shared_dir(tmp_path_factory, "tools_tiny")
    path = directory / "tools.pte"
    with exclusive(directory):
        if not path.is_file():
            tok = tool_tokenizer()
            model = tiny_llama(len(tok), tok.eos_token_id, hidden=32, layers=1)
            model.config.max_position_embeddings = MAX_SEQ_LEN  # the prompts hold the tools
            export_decoder(model, path, MAX_SEQ_LEN, batch=BATCH, tokenizer=tok,
                           config=SamplerConfig(top_k=True, logit_bias=4, allowed_mask=True))
    return path


def use_format(service, fmt: str) -> None:
    """Serve the program as a checkpoint of family `fmt`: its template and its call syntax (one export serves
    all four: the tokenizer has every family's markers)."""
    service.meta.tool_call_format = fmt
    service.tokenizer.chat_template = TEMPLATES[fmt]
    if hasattr(service.tokenizer, "_template"):  # LightTokenizer compiles its template once
        service.tokenizer._template = None
