"""Serving a decoder .pte: an engine thread with a batched decode loop, an OpenAI-compatible HTTP API
and LMTP (WebSocket and plain TCP lines), all in one process (`etmlx serve`)."""
