"""OpenAI-style errors: every refusal the server gives, as a status and a one-line message."""
from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the server refuses: ``status`` (400, 404, 503 ...), a one-line ``message`` and,
    when one parameter is to blame, its name in ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = " ".join(str(message).split())  # one line, whatever the cause wrote
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
            self.status, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
