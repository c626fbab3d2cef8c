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
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HELP = "[etmlx chat: type a message; /reset clears the conversation, /exit or Ctrl-D ends]"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Conversation:
    def __init__(self, tokenizer, max_seq_len: int, max_tokens: int, system_prompt: str | None = None):
        self.tokenizer, self.max_seq_len = tokenizer, max_seq_len
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
        from backends.mlx.llm.decoder.prompt import chat_prompt

        self.turns.append({"role": "user", "content": text})
        while True:
            ids = chat_prompt(self.tokenizer, self.system + self.turns)
            if len(ids) + self.reserve <= self.max_seq_len:
                return ids
            if len(self.turns) <= 1:
                self.turns.pop()
                _say(f"[this message makes a {len(ids)}-token prompt: with room for a reply it does not fit the "
                     f"program's max_seq_len {self.max_seq_len}; not sent]")
                return None
            # the oldest user message and its reply, never the new message (resumed turns may be odd)
            self.turns = self.turns[min(2, len(self.turns) - 1):]
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
                    isinstance(t, dict) and set(t) == {"role", "content"} and isinstance(t["role"], str)
                    and isinstance(t["content"], str) for t in turns):
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

        if not self.system + turns:
            return
        try:
            chat_text(self.tokenizer, self.system + turns)
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
    tokenizer = decoder.tokenizer  # raises, naming the missing tokenizer
    if not has_chat_template(tokenizer):
        raise ValueError(f"{decoder.pte}'s tokenizer has no chat template: use etmlx generate "
                         "--ignore-chat-template for raw text")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    chat = Conversation(tokenizer, decoder.meta.max_seq_len, args.max_tokens, args.system_prompt)
    store = getattr(args, "prompt_cache", None)
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
        budget = min(args.max_tokens, decoder.meta.max_seq_len - len(prompt))
        reply, last, ids = [], None, []
        for last in stream_text(decoder, prompt, budget, params, args.stop, tokenizer, reuse=True, speculation=drafts):
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
