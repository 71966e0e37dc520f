"""The engine seam: what every layer above inference sends and receives.

`EngineClient` is implemented by the in-process `AsyncEngine`, the HTTP client of a remote
`once engine`, the scripted engine used in tests, and (later) the router. Everything here
is plain data; nothing imports torch.
"""

import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, TypeGuard, runtime_checkable

from once.protocol.errors import InvalidRequestError

FINISH_STOP = "stop"  # a stop token or eos was sampled
FINISH_LENGTH = "length"  # max_tokens reached (or the forced output ran out)
FINISH_ABORT = "abort"  # aborted by the caller
FINISH_ERROR = "error"  # the engine failed this request; see TokenDelta.error


# What an output may be: a JSON value valid under a JSON Schema, any JSON object, a
# string of a Lark grammar (llguidance's dialect, as OpenAI's custom tools use), one
# matching a regex, or one of llguidance's grammar lists (a Lark grammar that names others
# as `@name`: how a call's grammar embeds a custom tool's).
CONSTRAINT_KINDS = ("json_schema", "json_object", "lark", "regex", "llguidance")

# The most alternatives a request may ask for per token: OpenAI's top_logprobs limit (and
# vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class OutputConstraint:
    """The grammar an output must follow; the engine enforces it token by token.

    `text` is the schema as JSON text (json_schema), empty (json_object), the grammar
    (lark), the pattern (regex) or `{"grammars": [...]}` as JSON text (llguidance). Only
    the shape is checked here; whether the engine can compile it is the engine's check,
    made before the request is admitted.
    """

    kind: str
    text: str = ""

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError(
                f"constraint kind must be one of {CONSTRAINT_KINDS}, got {self.kind!r}",
                param="constraint.kind",
            )
        if not isinstance(self.text, str):
            raise InvalidRequestError("constraint text must be a string", param="constraint.text")
        if self.kind == "json_object":
            if self.text:
                raise InvalidRequestError(
                    "a json_object constraint takes no text", param="constraint.text"
                )
        elif not self.text.strip():
            raise InvalidRequestError(
                f"a {self.kind} constraint needs its text", param="constraint.text"
            )
        if self.kind in ("json_schema", "llguidance"):
            try:
                value = json.loads(self.text)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"the {self.kind} constraint is not valid JSON: {exc}",
                    param="constraint.text",
                ) from None
            if self.kind == "json_schema" and not isinstance(value, dict | bool):
                raise InvalidRequestError(
                    "a JSON schema must be an object or a boolean", param="constraint.text"
                )
            if self.kind == "llguidance" and not (
                isinstance(value, dict) and isinstance(value.get("grammars"), list)
            ):
                raise InvalidRequestError(
                    'an llguidance constraint is an object with a "grammars" list',
                    param="constraint.text",
                )

    def to_dict(self) -> dict:
        return {"kind": self.kind, "text": self.text}

    @classmethod
    def from_dict(cls, data: dict) -> "OutputConstraint":
        if not isinstance(data, dict):
            raise InvalidRequestError("constraint must be an object", param="constraint")
        kind, text = data.get("kind"), data.get("text", "")
        if not isinstance(kind, str) or not isinstance(text, str):
            raise InvalidRequestError(
                "constraint kind and text must be strings", param="constraint.kind"
            )
        return cls(kind=kind, text=text)


@dataclass(frozen=True)
class SamplingParams:
    # temperature 0 means greedy; top_k 0 and top_p 1.0 mean "off".
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    # Structured outputs: the output must follow this grammar (forced outputs ignore it).
    constraint: OutputConstraint | None = None
    # Log probabilities of the output: None none, 0 each output token's own, k > 0 also
    # the k most likely ids at its position (TokenDelta.logprobs).
    logprobs: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0", param="top_k")
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be >= 1", param="max_tokens")
        if self.constraint is not None and not isinstance(self.constraint, OutputConstraint):
            raise InvalidRequestError("constraint must be an OutputConstraint", param="constraint")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidRequestError(
                f"logprobs must be null or an integer from 0 to {MAX_TOP_LOGPROBS}",
                param="logprobs",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_dict(self) -> dict:
        data = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
        }
        # Only when set: a free request's wire form stays what servers without
        # constraints accept (they reject unknown sampling fields).
        if self.constraint is not None:
            data["constraint"] = self.constraint.to_dict()
        if self.logprobs is not None:  # the same rule, for the same servers
            data["logprobs"] = self.logprobs
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "SamplingParams":
        data = dict(data)
        data["stop_token_ids"] = tuple(data.get("stop_token_ids") or ())
        constraint = data.get("constraint")
        if constraint is not None:
            data["constraint"] = OutputConstraint.from_dict(constraint)
        return cls(**data)


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # prompt_cache_key from the API: lets the router keep a session on one replica.
    session_key: str | None = None
    # Tenant isolation: the salt enters the hash of the first KV block, so two tenants
    # never share cached blocks even for identical prompts.
    cache_salt: str | None = None
    # Replay: decode exactly these ids (one target forward each) instead of sampling.
    forced_output_ids: tuple[int, ...] | None = None
    # Prefill/decode disaggregation, vLLM's field and keys: {"do_remote_decode": true} to a
    # prefill engine; to a decode engine, what the prefill engine's last delta returned
    # ({"do_remote_prefill": true, "remote_address": ...}; engine/kv/disagg/transfer.py).
    kv_transfer_params: dict | None = None

    def __post_init__(self):
        if not self.request_id:
            raise InvalidRequestError("request_id must not be empty", param="request_id")
        if len(self.prompt_token_ids) == 0:
            raise InvalidRequestError("prompt must not be empty", param="prompt_token_ids")
        if any((not isinstance(t, int)) or t < 0 for t in self.prompt_token_ids):
            raise InvalidRequestError(
                "prompt_token_ids must be non-negative integers", param="prompt_token_ids"
            )

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling": self.sampling.to_dict(),
            "session_key": self.session_key,
            "cache_salt": self.cache_salt,
            "forced_output_ids": (
                None if self.forced_output_ids is None else list(self.forced_output_ids)
            ),
            "kv_transfer_params": self.kv_transfer_params,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "GenerateRequest":
        forced = data.get("forced_output_ids")
        return cls(
            request_id=str(data.get("request_id") or ""),
            prompt_token_ids=tuple(data.get("prompt_token_ids") or ()),
            sampling=SamplingParams.from_dict(data.get("sampling") or {}),
            session_key=data.get("session_key"),
            cache_salt=data.get("cache_salt"),
            forced_output_ids=None if forced is None else tuple(forced),
            kv_transfer_params=_object_or_none(data.get("kv_transfer_params")),
        )


def _object_or_none(value: object) -> dict | None:
    if value is None or isinstance(value, dict):
        return value
    raise InvalidRequestError("kv_transfer_params must be an object", param="kv_transfer_params")


@dataclass
class RequestMetrics:
    """Per-request accounting, sent on the last delta."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_computed_tokens: int = 0  # prompt tokens actually prefilled (incl. recompute)
    # Of num_computed_tokens, prompt positions prefilled again after a preemption: always
    # num_prompt_tokens = num_cached_tokens + num_computed_tokens - num_recomputed_tokens.
    num_recomputed_tokens: int = 0
    num_tier_cached_tokens: int = 0  # of num_cached_tokens, brought in by a KV connector
    num_output_tokens: int = 0
    num_preemptions: int = 0
    ttft_s: float = 0.0  # arrival -> first output token
    mean_token_latency_s: float = 0.0  # mean gap between later output tokens
    e2e_s: float = 0.0
    queue_s: float = 0.0  # arrival -> first scheduled
    # Speculative decoding: verifications (drafts) run, ids drafted, drafts accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict) -> "RequestMetrics":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log probability, and the most likely ids at its position.

    `top_logprobs` holds the request's k most likely `(id, logprob)` pairs, most likely
    first (empty when it asked for 0); the token itself is among them when it ranks in
    the top k. Which distribution these come from is the engine's to say (once's engine:
    the model's own, before temperature and top-k/top-p; engine/logprobs.py).
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict:
        return {
            "token_id": self.token_id,
            "logprob": self.logprob,
            "top_logprobs": [[token_id, logprob] for token_id, logprob in self.top_logprobs],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "TokenLogprob":
        return cls(
            token_id=int(data["token_id"]),
            logprob=float(data["logprob"]),
            top_logprobs=tuple(
                (int(token_id), float(logprob))
                for token_id, logprob in data.get("top_logprobs") or ()
            ),
        )


@dataclass
class TokenDelta:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int | None = None  # set on the first delta of a request
    metrics: RequestMetrics | None = None  # set on the last delta
    error: dict | None = None  # OnceError.to_dict() when finish_reason == "error"
    # When the request asked (SamplingParams.logprobs) and the delta carries ids: one
    # entry per id in token_ids, in the same order.
    logprobs: list[TokenLogprob] | None = None
    # A prefill engine's last delta: where the decode engine finds the KV (vLLM's field).
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict:
        data: dict = {
            "request_id": self.request_id,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "num_cached_tokens": self.num_cached_tokens,
            "metrics": None if self.metrics is None else self.metrics.to_dict(),
            "error": self.error,
        }
        if self.logprobs is not None:  # only when set: other deltas keep their old form
            data["logprobs"] = [entry.to_dict() for entry in self.logprobs]
        if self.kv_transfer_params is not None:
            data["kv_transfer_params"] = self.kv_transfer_params
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "TokenDelta":
        metrics = data.get("metrics")
        logprobs = data.get("logprobs")
        return cls(
            request_id=data["request_id"],
            token_ids=list(data.get("token_ids") or []),
            finish_reason=data.get("finish_reason"),
            num_cached_tokens=data.get("num_cached_tokens"),
            metrics=None if metrics is None else RequestMetrics.from_dict(metrics),
            error=data.get("error"),
            logprobs=None if logprobs is None else [TokenLogprob.from_dict(e) for e in logprobs],
            kv_transfer_params=data.get("kv_transfer_params"),
        )


@runtime_checkable
class EngineClient(Protocol):
    """The one seam between the gateway/router and inference.

    `generate` yields deltas until one has a finish_reason. Errors detected before the
    request is admitted (too long, bad ids) raise an OnceError from the first iteration.
    """

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> dict: ...


def is_seconds(value: object) -> TypeGuard[int | float]:
    """A finite number of seconds >= 0 (not a bool)."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


@runtime_checkable
class SessionPauseHints(Protocol):
    """Optional beside EngineClient: the session's agent now runs a tool for about
    `expected_s` seconds (engine/kv/session_pauses.py says what an engine does with it)."""

    async def pause_session(self, session_key: str, expected_s: float) -> None: ...
