"""`etmlx chat FILE.pte`: a multi-turn conversation through the chat template, one stdin line per user
turn, each reply streamed as it decodes. Lines from a pipe work too (no prompt is drawn then).

/reset clears the conversation, /exit (or end of input) ends it. Each turn re-renders the whole
conversation; the program's KV cache still holds the turns before (runtime/decode_rows.h), so only the new
part is prefilled. A --draft-tokens program decodes each reply speculatively (the same tokens), its drafts by
default from prompt lookup over the conversation so far (cli/draft_flags.py), the cache reused the same way;
the drafts accepted are summed up on stderr at the end. When it no longer fits the program's max_seq_len with room for a reply, the oldest
exchanges are dropped, and said so (the next turn then prefills from the start).
--prompt-cache FILE keeps the conversation in FILE (llm/decoder/cache_file.py: its messages, tokens and KV
entries): saved after each reply and /reset, resumed from it at start when it exists (the same program), so
the first turn after a restart prefills only itself.
--tools FILE lets the model call functions (llm/decoder/tool_turn.py): each call is shown on stderr and its result
read from stdin (or from --tool-exec COMMAND, which gets the call as JSON on stdin), then the model answers again
with the results, up to MAX_TOOL_ROUNDS times a turn.
--image PATH (repeatable; a vision-language program) puts the images before the first message's text; later turns
re-render them, and the prompt cache, keyed by their content, keeps them prefilled.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HELP = "[etmlx chat: type a message; /reset clears the conversation, /exit or Ctrl-D ends]"
MAX_TOOL_ROUNDS = 8  # answers with calls in a row before the turn is ended (a model that never stops calling)
TOOL_EXEC_TIMEOUT = 60.0


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Conversation:
    def __init__(self, tokenizer, max_seq_len: int, max_tokens: int, system_prompt: str | None = None, tools=None,
                 meta=None, images=()):
        self.tokenizer, self.max_seq_len = tokenizer, max_seq_len
        # --image: a vision-language program's images (`meta` its DecoderMeta), parts of the first user message
        self.meta, self.pending = meta, list(images)
        self.images: list = []  # the images of the last rendered prompt, in order
        self.tools = tools  # a ToolRequest: the prompt renders them, and calls and results are turns
        # room kept for each reply: the reply limit, but at most a quarter of the cache, so that a
        # long limit does not leave room for only the newest message
        self.reserve = max(1, min(max_tokens, max_seq_len // 4))
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        self.turns: list[dict] = []

    def reset(self) -> None:
        self.turns = []

    def prompt_for(self, text: str) -> list[int] | None:
        """The prompt ids with `text` as the next user turn, dropping the oldest exchanges to fit; None
        (and the turn not kept) when the message alone does not fit."""
        content = text
        if self.pending:
            content = [{"type": "image", "image": image} for image in self.pending] + [{"type": "text", "text": text}]
            self.pending = []
        self.turns.append({"role": "user", "content": content})
        return self.fit()

    def render(self) -> list[int]:
        from backends.mlx.llm.decoder.prompt import chat_prompt
        from backends.mlx.llm.decoder.tool_prompt import tool_chat_prompt

        self.images = []
        if any(isinstance(t["content"], list) for t in self.turns):
            from backends.mlx.llm.decoder.image_prompt import image_chat_prompt

            ids, self.images = image_chat_prompt(self.tokenizer, self.meta, self.system + self.turns)
            return ids
        if self.tools is None:
            return chat_prompt(self.tokenizer, self.system + self.turns)
        return tool_chat_prompt(self.tokenizer, self.system + self.turns, self.tools.tools, self.tools.fmt)

    def fit(self) -> list[int] | None:
        """The prompt ids of the conversation so far, dropping the oldest exchanges to fit; None (and the newest
        user turn dropped) when that message alone does not fit."""
        while True:
            ids = self.render()
            if len(ids) + self.reserve <= self.max_seq_len:
                return ids
            if sum(t["role"] == "user" for t in self.turns) <= 1:
                self.turns = self.turns[:max(i for i, t in enumerate(self.turns) if t["role"] == "user")]
                _say(f"[this message makes a {len(ids)}-token prompt: with room for a reply it does not fit the "
                     f"program's max_seq_len {self.max_seq_len}; not sent]")
                return None
            # the oldest user message and what answers it (the reply, calls and results)
            self.turns = self.turns[next(i for i, t in enumerate(self.turns) if i and t["role"] == "user"):]
            _say(f"[the conversation is full (max_seq_len {self.max_seq_len}): dropped the oldest exchange]")

    def answered(self, reply: str) -> None:
        self.turns.append({"role": "assistant", "content": reply})

    def save(self, path, decoder, tokens: list[int]) -> None:
        """The conversation (its messages; `tokens`: the last prompt and reply) and its KV entries into `path`."""
        from backends.mlx.llm.decoder import cache_file

        cache_file.save(path, decoder, tokens, {"etmlx.chat.turns": json.dumps(self.turns)})

    def resume(self, path, decoder) -> int:
        """The conversation saved in `path` (its KV entries back into the program); the tokens restored."""
        from backends.mlx.llm.decoder import cache_file

        _, held, metadata = cache_file.load(path, decoder)
        try:
            turns = json.loads(metadata["etmlx.chat.turns"])
            if not isinstance(turns, list) or not all(
                    isinstance(t, dict) and {"role", "content"} <= set(t) and isinstance(t["role"], str)
                    and isinstance(t["content"], (str, type(None))) for t in turns):
                raise ValueError
        except (KeyError, ValueError, TypeError, RecursionError):
            raise ValueError(f"{path} holds no etmlx chat (saved by another tool?)") from None
        self._check_template(path, turns)
        self.turns = turns
        return held

    def _check_template(self, path, turns: list[dict]) -> None:
        """Saved turns (with this run's system prompt) must be a conversation the chat template renders."""
        import jinja2

        from backends.mlx.llm.decoder.prompt import chat_text
        from backends.mlx.llm.decoder.tool_prompt import tool_chat_text

        if not self.system + turns:
            return
        try:
            if self.tools is None:
                chat_text(self.tokenizer, self.system + turns)
            else:  # turns with tool calls and results
                tool_chat_text(self.tokenizer, self.system + turns, self.tools.tools, self.tools.fmt)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise ValueError(f"{path} holds messages the chat template refuses: {exc}") from None


def run_chat(args, params) -> int:
    from backends.mlx.cli.draft_flags import speculation_from_args
    from backends.mlx.cli.generate_command import pte_path
    from backends.mlx.llm.decoder.prompt import has_chat_template
    from backends.mlx.llm.decoder.speculation import load_decoder
    from backends.mlx.llm.decoder.text_generation import stream_text

    decoder = load_decoder(pte_path(args))
    drafts = speculation_from_args(args, decoder)  # None: a plain program
    decoder.meta.adapter_index(args.adapter_name)  # an unknown adapter: one line, before the conversation
    tokenizer = decoder.tokenizer  # raises, naming the missing tokenizer
    if not has_chat_template(tokenizer):
        raise ValueError(f"{decoder.pte}'s tokenizer has no chat template: use etmlx generate "
                         "--ignore-chat-template for raw text")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    tools = _tools_from_args(args, decoder)
    store = getattr(args, "prompt_cache", None)
    images = _images_from_args(args, decoder, tools, store)
    chat = Conversation(tokenizer, decoder.meta.max_seq_len, args.max_tokens, args.system_prompt, tools,
                        meta=decoder.meta, images=images)
    if store:
        from backends.mlx.llm.decoder.cache_file import check_no_rings

        check_no_rings(decoder, "kept in a file")
    if store and Path(store).is_file():
        held = chat.resume(store, decoder)
        _say(f"[resumed {len(chat.turns)} messages from {store}: {held} tokens cached]")
    proposed = accepted = 0
    interactive = sys.stdin.isatty()
    if interactive:
        _say(HELP)
    while True:
        if interactive:
            print(">> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.rstrip("\r\n")
        command = text.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            chat.reset()
            if store:
                chat.save(store, decoder, [])
            _say("[conversation cleared]")
            continue
        if command.startswith("/") and command[1:].isalpha():
            _say(f"[unknown command {command}: /reset or /exit]")
            continue
        prompt = chat.prompt_for(text)
        if prompt is None:
            continue
        if tools is not None:
            _tool_exchange(chat, decoder, args, params, tools)
            continue
        budget = min(args.max_tokens, decoder.meta.max_seq_len - len(prompt))
        reply, last, ids = [], None, []
        for last in stream_text(decoder, prompt, budget, params, args.stop, tokenizer, reuse=True, speculation=drafts,
                                images=chat.images, adapter=args.adapter_name):
            reply.append(last.text)
            ids.append(last.token)
            print(last.text, end="", flush=True)
        print(flush=True)
        chat.answered("".join(reply))
        if store:
            chat.save(store, decoder, prompt + ids)
        if last is not None:
            proposed, accepted = proposed + last.proposed_draft_tokens, accepted + last.accepted_draft_tokens
    if drafts is not None:
        _say(f"[speculative decoding: {accepted} of {proposed} drafted tokens accepted]")
    return 0


def _images_from_args(args, decoder, tools, store) -> list:
    if not getattr(args, "image", None):
        return []
    from backends.mlx.cli.prompt_args import read_image
    from backends.mlx.llm.decoder.image_prompt import load_image, refuse_text_only

    refuse_text_only(decoder.meta, decoder.pte)
    if tools is not None or store:
        raise ValueError("--image with --tools or --prompt-cache is not supported")
    return [read_image(path, load_image) for path in args.image]


def _tools_from_args(args, decoder):
    """--tools FILE as a ToolRequest (None without it); a bad file is one line naming it."""
    if not getattr(args, "tools", None):
        if getattr(args, "tool_exec", None):
            raise ValueError("--tool-exec needs --tools")
        return None
    from backends.mlx.llm.decoder.tool_calls import ToolRequest, parse_tools, tool_format
    from backends.mlx.llm.decoder.tool_turn import tool_constraint

    try:
        raw = json.loads(Path(args.tools).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--tools {args.tools}: {exc}") from None
    choice = args.tool_choice
    named = choice not in ("auto", "required", "none")
    request = ToolRequest(parse_tools(raw, f"--tools {args.tools}"), "function" if named else choice,
                          choice if named else None, True, tool_format(decoder.meta, decoder.tokenizer))
    tool_constraint(decoder, request)  # "required" on a program that cannot constrain: refused before the chat
    return request


def _run_tool(command: str | None, call) -> str:
    """The result of one call: --tool-exec's stdout, or a line the user types."""
    if command is None:
        _say(f"[result of {call.name}? one line]")
        return sys.stdin.readline().rstrip("\r\n")
    import shlex
    import subprocess

    payload = json.dumps({"name": call.name, "arguments": call.arguments})
    try:
        done = subprocess.run(shlex.split(command), input=payload, capture_output=True, text=True,
                              timeout=TOOL_EXEC_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"error: {exc}"
    if done.returncode != 0:
        return f"error: exit status {done.returncode}: {done.stderr.strip()[:500]}"
    return done.stdout.strip()


def _tool_exchange(chat: Conversation, decoder, args, params, tools) -> None:
    """One user turn with tools: answer, run the calls, give the results back, until an answer calls nothing."""
    import dataclasses

    from backends.mlx.llm.decoder.tool_turn import tool_turn

    request = tools
    for _ in range(MAX_TOOL_ROUNDS):
        if chat.fit() is None:
            return
        reply, _, _ = tool_turn(decoder, chat.system + chat.turns, request, args.max_tokens, params, args.stop,
                                on_text=lambda piece: print(piece, end="", flush=True), reuse=True,
                                adapter=args.adapter_name)
        print(flush=True)
        chat.turns.append(reply.message())
        if not reply.tool_calls:
            return
        for call_id, call in zip(reply.ids, reply.tool_calls):
            _say(f"[tool call: {call.name}({call.arguments_json})]")
            result = _run_tool(args.tool_exec, call)
            _say(f"[result: {result}]")
            chat.turns.append({"role": "tool", "tool_call_id": call_id, "content": result})
        request = dataclasses.replace(tools, choice="auto", function=None)  # after results: answer or call again
    _say(f"[{MAX_TOOL_ROUNDS} answers in a row called tools: turn ended]")
