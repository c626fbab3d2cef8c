"""OpenAI's error object: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
