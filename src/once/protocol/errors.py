"""One error tree for every layer.

Each error carries an API error code (the `code` field of an OpenAI-style error body) and
an HTTP status, so any layer can turn it into a clear response instead of a 500.
"""


class OnceError(Exception):
    code = "server_error"
    status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def to_dict(self) -> dict:
        return {
            "type": self.error_type,
            "code": self.code,
            "message": self.message,
            "param": self.param,
        }


class InvalidRequestError(OnceError):
    code = "invalid_request"
    status = 400
    error_type = "invalid_request_error"


class InvalidJSONError(InvalidRequestError):
    code = "invalid_json"


class RouteNotFoundError(InvalidRequestError):
    code = "not_found"
    status = 404


class MethodNotAllowedError(InvalidRequestError):
    code = "method_not_allowed"
    status = 405


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class ModelNotFoundError(OnceError):
    code = "model_not_found"
    status = 404
    error_type = "invalid_request_error"


class ModelLoadError(OnceError):
    code = "model_load_failed"
    status = 400
    error_type = "invalid_request_error"


class UnsupportedModelError(ModelLoadError):
    code = "unsupported_architecture"


class RequestNotFoundError(OnceError):
    code = "request_not_found"
    status = 404
    error_type = "invalid_request_error"


class EngineOverloadedError(OnceError):
    code = "engine_overloaded"
    status = 503
    error_type = "server_error"


class EngineDeadError(OnceError):
    code = "engine_unavailable"
    status = 503
    error_type = "server_error"


class AuthenticationError(OnceError):
    code = "invalid_api_key"
    status = 401
    error_type = "invalid_request_error"


class RateLimitError(OnceError):
    code = "rate_limit_exceeded"
    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, param: str | None = None, retry_after_s: float = 1.0):
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class PayloadTooLargeError(InvalidRequestError):
    code = "payload_too_large"
    status = 413


class PreviousResponseNotFoundError(InvalidRequestError):
    # Unknown, expired, deleted, or owned by another tenant: all look the same from outside.
    code = "previous_response_not_found"


class ResponseNotFoundError(InvalidRequestError):
    code = "response_not_found"
    status = 404


class ResponseInFlightError(InvalidRequestError):
    # WebSocket mode: one response in flight per connection.
    code = "response_already_in_progress"
    status = 409


class ConnectionLimitError(InvalidRequestError):
    # WebSocket mode: the connection reached its age limit; open a new one.
    code = "websocket_connection_limit_reached"


class ContentFilterError(InvalidRequestError):
    code = "content_filter"


class RequestTimeoutError(InvalidRequestError):
    # The client sent its request body too slowly (a slowloris).
    code = "request_timeout"
    status = 408


ERRORS_BY_CODE = {
    cls.code: cls
    for cls in (
        OnceError,
        InvalidRequestError,
        InvalidJSONError,
        RouteNotFoundError,
        MethodNotAllowedError,
        ContextLengthExceededError,
        ModelNotFoundError,
        ModelLoadError,
        UnsupportedModelError,
        RequestNotFoundError,
        EngineOverloadedError,
        EngineDeadError,
        AuthenticationError,
        RateLimitError,
        PayloadTooLargeError,
        PreviousResponseNotFoundError,
        ResponseNotFoundError,
        ResponseInFlightError,
        ConnectionLimitError,
        ContentFilterError,
        RequestTimeoutError,
    )
}


def error_from_dict(body: dict) -> OnceError:
    """Rebuild an error that crossed a process boundary (engine server -> client)."""
    cls = ERRORS_BY_CODE.get(body.get("code", ""), OnceError)
    return cls(body.get("message", "unknown error"), param=body.get("param"))
