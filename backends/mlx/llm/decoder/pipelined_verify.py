"""A pipelined draft-verifying program: calls without drafts overlap the host's work with the device's step.

A draft-verifying call must return its own outputs (the host places the next call after the drafts it
accepts), so it cannot be pipelined as a plain program is (pipelined.py): the host would wait for every step,
including the calls of a source that has nothing to propose. This wrapper lets the host choose per call:

    deliver [B] bool:  true   returns (accepted, token) of this call: the host waits for them
                       false  returns (0, the row's previous call's token): already computed, no wait
    tokens < 0 (meta.py FED_BACK) means the row's last sampled token, as in a pipelined plain program
    outputs: accepted [B], token [B], fed [B] (the token this call's column 0 used in place of FED_BACK)

The runtime resolves a `where` whose condition the host holds at build time (interpreter.cpp exec_where), so a
call with deliver false has outputs that depend only on the previous call's state, and the runtime does not
wait for the step it has just started (backend.cpp). The decode-step rules decide `deliver`
(runtime/decode_rows.h: a call delivers when a row carries drafts or wants its last token for its source).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from backends.mlx.llm.decoder.speculative_head import DraftVerifyingHead


class DeliveredOrFedBack(nn.Module):
    """Wraps a DraftVerifyingHead: its inputs plus `deliver`, its outputs plus `fed`."""

    def __init__(self, head: DraftVerifyingHead, batch: int):
        super().__init__()
        self.head = head
        self.register_buffer("last_token", torch.zeros((batch,), dtype=torch.int64))

    def forward(self, tokens, start_pos, lengths, verify, deliver, **knobs):
        previous = self.last_token.clone()  # read before the update below
        tokens = torch.where(tokens < 0, previous.unsqueeze(1), tokens)
        accepted, token = self.head(tokens, start_pos, lengths, verify, **knobs)
        self.last_token.copy_(token)
        # An undelivered call carried no drafts (the rules deliver any call that does): nothing accepted; nor
        # does a call of the plain step (a call without drafts), whatever `deliver` says.
        none = torch.zeros_like(previous)
        return (none if self.head.plain_step else torch.where(deliver, accepted, none),
                torch.where(deliver, token, previous), previous)

    # torch.export names the inputs by forward's signature: the head's, with `deliver` after `verify`.
    _head = inspect.signature(DraftVerifyingHead.forward)
    _params = list(_head.parameters.values())
    _at = [p.name for p in _params].index("verify") + 1
    forward.__signature__ = _head.replace(parameters=_params[:_at] + [
        inspect.Parameter("deliver", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + _params[_at:])
    del _head, _params, _at
