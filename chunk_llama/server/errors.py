"""`OpenAIError`: a request the server refuses, as OpenAI's error body."""

from __future__ import annotations


class OpenAIError(Exception):
    """A request the server refuses, sent as `{"error": {"message", "type", "param", "code"}}`
    with `status` and the response `headers` (`Retry-After`...)."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type
        self.code, self.headers = code, headers

    def body(self) -> dict:
        """The JSON error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
