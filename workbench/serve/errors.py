"""The error a request gets: an HTTP status and OpenAI's error JSON."""

from __future__ import annotations

from typing import Any


class RequestError(ValueError):
    """A request the server cannot take; `status` is the HTTP status, `code` OpenAI's code,
    `headers` extra response headers (Retry-After)."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request",
                 kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind
        self.headers = headers or {}


def error_body(message: str, code: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "code": code, "param": None}}


def shown(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: what an error message echoes of a request."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
