"""The decode-step rules of decode_rows.cpp and the draft sources of draft_sources.cpp (one implementation,
also etmlx_decode's), through ctypes: the C functions of libetmlx_runner.so (decode_rows_api.cpp), the runner
library beside the backend's.

`RowsCore`, `DraftSourceCore`, `BudgetCore` and `PacingCore` are thin typed wrappers: lists of ints in and out, a one-line
`DecodeRowsError` for what the core refuses. The Python engine over them (what a row's request, matcher and
draft source are) is llm/decoder/decode_rows.py; the draft sources' Python API is llm/decoder/draft_sources.py.
"""

from __future__ import annotations

import ctypes
from array import array

_i64 = ctypes.c_int64
_P64 = ctypes.POINTER(_i64)
COPY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, _i64, _i64, _i64)
ADVANCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, _i64, _i64)
ROW_FIELDS = ("pos", "cached", "step", "produced", "calls", "proposed", "accepted", "feed_length")
EVENT_FIELDS = ("slot", "token", "finish", "failure", "detail", "cached", "proposed", "accepted")
LAYOUT_ARRAYS = ("start_pos", "lengths", "seeds", "steps", "first", "kinds", "forced", "deliver")
FEED, DRAFTS, OUTPUT, HELD, PROMPT = range(5)
FINISH = (None, "stop", "length", "error")
NO_FAILURE, FORCED_FAILURE, NO_TOKEN, GRAMMAR = range(4)  # Failure
IDLE, REQUEST, FORCED, GREEDY = range(4)  # RowKind


class DecodeRowsError(ValueError):
    """A request the rules refuse (one line: a busy row, a bad slot, more drafts than room, ...)."""


def _lib() -> ctypes.CDLL:
    from backends.mlx import runtime

    lib = runtime.load_runner()
    if not hasattr(lib, "etmlx_rows_new"):
        raise DecodeRowsError(f"{runtime.runner_library_path()} has no decode-step rules: rebuild it (`make setup`)")
    if getattr(lib, "_etmlx_rows_typed", False):
        return lib
    vp = ctypes.c_void_p
    lib.etmlx_rows_error.restype = ctypes.c_char_p
    lib.etmlx_rows_new.restype = vp
    lib.etmlx_rows_new.argtypes = [_i64, _i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, _i64, _i64, _P64, _i64,
                                   ctypes.c_int]
    lib.etmlx_rows_free.argtypes = [vp]
    lib.etmlx_rows_free.restype = None
    signatures = {
        "fields": [_i64], "active": [vp], "copies": [vp], "row": [vp, _i64, ctypes.c_int, _P64],
        "tokens": [vp, _i64, _i64, ctypes.c_int, _P64, _i64], "reusable": [vp, _i64, _P64, _i64],
        "set_held": [vp, _i64, _P64, _i64], "taken": [vp, _i64], "used": [vp, _i64], "forget": [vp],
        "room": [vp], "choose": [vp, _P64, _i64, _i64, ctypes.c_int, _P64], "busy_prefix": [vp, _P64, _i64, _P64],
        "start": [vp, _i64, _P64, _i64, _i64, ctypes.c_int, _P64, _i64, _i64, ctypes.c_int, ctypes.c_int, _i64, COPY_FN,
                  vp],
        "end": [vp, _i64], "place": [vp, _i64, _i64, _i64], "draft_room": [vp, _i64, _i64], "ask": [vp, _i64, _i64],
        "set_drafts": [vp, _i64, _P64, _i64], "layout": [vp, _i64], "layout_copy": [vp, _P64, _P64],
        "read": [vp, _P64, _P64, _P64, ADVANCE_FN, vp, _P64, _i64],
        "failure_message": [_i64, _i64, ctypes.c_char_p, _i64],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, f"etmlx_rows_{name}")
        fn.argtypes, fn.restype = argtypes, _i64
    if [lib.etmlx_rows_fields(i) for i in range(3)] != [len(ROW_FIELDS), len(EVENT_FIELDS), len(LAYOUT_ARRAYS)]:
        raise DecodeRowsError(f"{runtime.runner_library_path()} lays out rows differently: rebuild it (`make setup`)")
    vd = ctypes.c_double
    for name, restype, argtypes in (
            ("etmlx_draft_ngram_new", vp, [_i64, _i64]), ("etmlx_draft_ngram_default", _i64, [_i64]),
            ("etmlx_draft_prediction_new", vp, [_P64, _i64]),
            ("etmlx_draft_free", None, [vp]), ("etmlx_draft_propose", _i64, [vp, _P64, _i64, _P64, _i64, _i64, _P64, _i64]),
            ("etmlx_budget_new", vp, [_i64, vd]), ("etmlx_budget_free", None, [vp]), ("etmlx_budget_size", _i64, [vp]),
            ("etmlx_budget_update", _i64, [vp, _i64, _i64]), ("etmlx_budget_get", _i64, [vp, ctypes.POINTER(vd)]),
            ("etmlx_budget_set_cost", _i64, [vp, vd]), ("etmlx_budget_constant", vd, [_i64]),
            ("etmlx_pacing_new", vp, [_i64, vd, ctypes.c_int]), ("etmlx_pacing_free", None, [vp]),
            ("etmlx_pacing_begin", _i64, [vp, _P64, _i64, vd]),
            ("etmlx_pacing_end", _i64, [vp, _P64, _i64, ctypes.c_int, _P64, _i64, _i64, vd, vd]),
            ("etmlx_pacing_get", _i64, [vp, ctypes.POINTER(vd)])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    lib._etmlx_rows_typed = True
    return lib


def default_prefill_chunk() -> int:
    """The decode loops' prompt tokens per prefill call (decode_rows.h kPrefillChunk)."""
    return int(_lib().etmlx_rows_fields(3))


def _ids(values) -> tuple[ctypes.Array, int]:
    """A token list as a ctypes int64 array (sharing an array.array's memory: built at C speed, which matters for
    the whole sequence a draft model's proposal hands over, several times per proposal) and its length."""
    ids = array("q", values)  # a value that is not an integer is a TypeError here
    if not ids:
        return (_i64 * 1)(), 0
    return (_i64 * len(ids)).from_buffer(ids), len(ids)


class RowsCore:
    """One DecodeRows of decode_rows.cpp (see decode_rows.h for the rules)."""

    def __init__(self, batch: int, max_seq_len: int, *, ring: bool, prompt_cache: bool, pipelined: bool,
                 draft_tokens: int, eos: list[int], copies: bool, propose_tokens: int = 0):
        self._lib = _lib()
        eos_ids, n = _ids(eos)
        handle = self._lib.etmlx_rows_new(batch, max_seq_len, ring, prompt_cache, pipelined, draft_tokens,
                                          propose_tokens, eos_ids, n, copies)
        if not handle:
            raise DecodeRowsError(self._lib.etmlx_rows_error().decode())
        self._h = ctypes.c_void_p(handle)
        self.batch, self.draft_tokens = batch, draft_tokens
        self.copies = bool(self._check(self._lib.etmlx_rows_copies(self._h)))
        self.error: BaseException | None = None  # what a callback raised, re-raised by the call that made it

    def __del__(self):
        if getattr(self, "_h", None):
            self._lib.etmlx_rows_free(self._h)
            self._h = None

    def _check(self, rc: int) -> int:
        if rc >= 0:
            self.error = None  # a callback's exception the core got past (a failed copy) is not this call's
        else:
            error, self.error = self.error, None
            if error is not None:
                raise error
            raise DecodeRowsError(self._lib.etmlx_rows_error().decode())
        return rc

    def _call(self, name: str, *args) -> int:
        return self._check(getattr(self._lib, f"etmlx_rows_{name}")(self._h, *args))

    # ---- reading a row ----
    def row(self, slot: int, ended: bool = False) -> dict | None:
        """The row's state (`ended`: of the last row that ended in the slot), None when there is none."""
        out = (_i64 * len(ROW_FIELDS))()
        return dict(zip(ROW_FIELDS, out)) if self._call("row", slot, ended, out) else None

    def tokens(self, slot: int, which: int, ended: bool = False) -> list[int]:
        cap = 256
        while True:
            out = (_i64 * cap)()
            n = self._call("tokens", slot, which, ended, out, cap)
            if n <= cap:
                return list(out[:n])
            cap = n

    @property
    def active(self) -> int:
        return self._call("active")

    # ---- the row caches ----
    def reusable(self, slot: int, prompt: list[int]) -> int:
        return self._call("reusable", slot, *_ids(prompt))

    def set_held(self, slot: int, tokens: list[int]) -> None:
        self._call("set_held", slot, *_ids(tokens))

    def taken(self, slot: int) -> None:
        self._call("taken", slot)

    def used(self, slot: int) -> int:
        return self._call("used", slot)

    def forget(self) -> None:
        self._call("forget")

    # ---- rows come and go ----
    def room(self) -> int:
        return self._call("room")

    def choose(self, prompt: list[int], usable: int, reuse: bool) -> tuple[int | None, int]:
        out = (_i64 * 2)()
        self._call("choose", *_ids(prompt), usable, reuse, out)
        return (None if out[0] < 0 else int(out[0])), int(out[1])

    def busy_prefix(self, prompt: list[int]) -> tuple[int | None, int, int]:
        out = (_i64 * 3)()
        self._call("busy_prefix", *_ids(prompt), out)
        return (None if out[0] < 0 else int(out[0])), int(out[1]), int(out[2])

    def start(self, slot: int, prompt: list[int], max_tokens: int, stop_at_eos: bool, forced: list[int] | None,
              seed: int, constrained: bool, reuse: bool, copy=None, prefill_chunk: int = 0) -> int:
        """copy(src, dst, n) -> bool; an exception in it fails the start and is re-raised. `prefill_chunk` > 0:
        the prompt is prefilled in calls of at most that many tokens (decode_rows.h RowRequest)."""
        forced_ids, n_forced = _ids(forced or [])
        callback = COPY_FN(self._callback(copy, lambda ok: 1 if ok else 0)) if copy else COPY_FN()
        return self._call("start", slot, *_ids(prompt), max_tokens, stop_at_eos, forced_ids,
                          n_forced if forced is not None else -1, seed, constrained, reuse, prefill_chunk, callback,
                          None)

    def end(self, slot: int) -> None:
        self._call("end", slot)

    def place(self, slot: int, pos: int, step: int) -> None:
        self._call("place", slot, pos, step)

    # ---- one call ----
    def draft_room(self, slot: int, limit: int) -> int:
        return self._call("draft_room", slot, limit)

    def ask(self, slot: int, limit: int) -> int:
        """Drafts to ask row `slot`'s source for now (decode_rows.h DecodeRows::ask)."""
        return self._call("ask", slot, limit)

    def set_drafts(self, slot: int, drafts: list[int]) -> None:
        self._call("set_drafts", slot, *_ids(drafts))

    def layout(self, only: int | None = None) -> tuple[list[list[int]], dict[str, list[int]]]:
        """(tokens [batch][width], {array name: [batch]}) of the next call."""
        width = self._call("layout", -1 if only is None else only)
        tokens, per_row = (_i64 * (self.batch * width))(), (_i64 * (self.batch * len(LAYOUT_ARRAYS)))()
        self._call("layout_copy", tokens, per_row)
        flat, b = list(tokens), self.batch
        rows = [flat[i * width:(i + 1) * width] for i in range(b)]
        return rows, {name: list(per_row[k * b:(k + 1) * b]) for k, name in enumerate(LAYOUT_ARRAYS)}

    def read(self, tokens: list[int], accepted: list[int] | None, advance=None, fed: list[int] | None = None) -> list[dict]:
        """advance(slot, token) -> bool (False: the grammar rejected it); an exception in it is re-raised.
        `fed`: a pipelined draft program's third output."""
        toks, _ = _ids(tokens)
        acc = _ids(accepted)[0] if accepted is not None else None
        fed_ids = _ids(fed)[0] if fed is not None else None
        cap = self.batch * (self.draft_tokens + 2)  # a pending token, then up to K drafts and the next token
        events = (_i64 * (cap * len(EVENT_FIELDS)))()
        callback = ADVANCE_FN(self._callback(advance, lambda ok: 1 if ok else 0)) if advance else ADVANCE_FN()
        n = self._call("read", toks, acc, fed_ids, callback, None, events, cap)
        w = len(EVENT_FIELDS)
        return [dict(zip(EVENT_FIELDS, events[i * w:(i + 1) * w])) for i in range(n)]

    def failure_message(self, failure: int, detail: int) -> str:
        buf = ctypes.create_string_buffer(256)
        self._check(self._lib.etmlx_rows_failure_message(failure, detail, buf, 256))
        return buf.value.decode()

    def _callback(self, fn, convert):
        """A ctypes callback around fn: its exception is kept (and the core told to fail) instead of lost."""
        def call(_ctx, *args):
            try:
                return convert(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - re-raised by _check once the core has returned
                self.error = exc
                return -1
        return call


def _made(lib, handle) -> ctypes.c_void_p:
    if not handle:
        raise DecodeRowsError(lib.etmlx_rows_error().decode())
    return ctypes.c_void_p(handle)


def _checked(lib, rc: int) -> int:
    if rc < 0:
        raise DecodeRowsError(lib.etmlx_rows_error().decode())
    return rc


class DraftSourceCore:
    """A draft source of draft_sources.cpp: `ngram(max_ngram, min_ngram)` or `prediction(ids)`."""

    def __init__(self, handle, lib):
        self._lib, self._h = lib, handle

    @classmethod
    def ngram(cls, max_ngram: int, min_ngram: int) -> "DraftSourceCore":
        lib = _lib()
        return cls(_made(lib, lib.etmlx_draft_ngram_new(max_ngram, min_ngram)), lib)

    @staticmethod
    def ngram_defaults() -> tuple[int, int]:
        """NgramDraft's default (max_ngram, min_ngram), as the core defines them."""
        lib = _lib()
        return int(lib.etmlx_draft_ngram_default(0)), int(lib.etmlx_draft_ngram_default(1))

    @classmethod
    def prediction(cls, prediction: list[int]) -> "DraftSourceCore":
        lib = _lib()
        ids, n = _ids(prediction)
        return cls(_made(lib, lib.etmlx_draft_prediction_new(ids, n)), lib)

    def __del__(self):
        if getattr(self, "_h", None):
            self._lib.etmlx_draft_free(self._h)
            self._h = None

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        if k < 1:
            return []
        p, np_ = _ids(prompt)
        o, no = _ids(output)
        out = (_i64 * k)()
        n = _checked(self._lib, self._lib.etmlx_draft_propose(self._h, p, np_, o, no, k, out, k))
        return list(out[:n])


class BudgetCore:
    """The DraftBudget of draft_sources.cpp."""

    def __init__(self, max_drafts: int, draft_cost: float | None = None):
        self._lib = lib = _lib()
        cost = self.constant(0) if draft_cost is None else float(draft_cost)
        self._h = _made(lib, lib.etmlx_budget_new(max_drafts, cost))

    @staticmethod
    def constant(which: int) -> float:
        """0: the default cost per draft, 1: the decay, 2: the calls between probes."""
        return _lib().etmlx_budget_constant(which)

    def __del__(self):
        if getattr(self, "_h", None):
            self._lib.etmlx_budget_free(self._h)
            self._h = None

    def size(self) -> int:
        return _checked(self._lib, self._lib.etmlx_budget_size(self._h))

    def update(self, proposed: int, accepted: int) -> None:
        _checked(self._lib, self._lib.etmlx_budget_update(self._h, proposed, accepted))

    def _get(self) -> tuple[float, float]:
        out = (ctypes.c_double * 2)()
        _checked(self._lib, self._lib.etmlx_budget_get(self._h, out))
        return out[0], out[1]

    @property
    def rate(self) -> float:
        return self._get()[0]

    @property
    def draft_cost(self) -> float:
        return self._get()[1]

    @draft_cost.setter
    def draft_cost(self, cost: float) -> None:
        _checked(self._lib, self._lib.etmlx_budget_set_cost(self._h, float(cost)))


class PacingCore:
    """The DraftModelPacing of draft_sources.cpp: a draft model's budget, learned from its proposals."""

    def __init__(self, max_drafts: int, cost: float | None = None, one_call: bool = False):
        """`one_call`: each proposal is one draft program call, whatever its size (a --propose-tokens program)."""
        self._lib = lib = _lib()
        self._h = _made(lib, lib.etmlx_pacing_new(max_drafts, -1.0 if cost is None else float(cost), int(one_call)))

    def __del__(self):
        if getattr(self, "_h", None):
            self._lib.etmlx_pacing_free(self._h)
            self._h = None

    def begin(self, seq: list[int], now: float) -> int:
        ids, n = _ids(seq)
        return _checked(self._lib, self._lib.etmlx_pacing_begin(self._h, ids, n, now))

    def end(self, seq: list[int], has_output: bool, drafts: list[int], calls: int, seconds: float, now: float) -> None:
        ids, n = _ids(seq)
        d, nd = _ids(drafts)
        _checked(self._lib, self._lib.etmlx_pacing_end(self._h, ids, n, int(has_output), d, nd, calls, seconds, now))

    def get(self) -> tuple[int, float, float, float]:
        """(draft program calls, their seconds, the acceptance estimate, the cost per draft)."""
        return self._get()[:4]

    def proposal_cost(self) -> float:
        """The budget's cost per proposal (a one-call draft program's call), in plain calls."""
        return self._get()[4]

    def _get(self) -> tuple[int, float, float, float, float]:
        out = (ctypes.c_double * 5)()
        _checked(self._lib, self._lib.etmlx_pacing_get(self._h, out))
        return int(out[0]), out[1], out[2], out[3], out[4]
