"""The gateway's one frozen config: flags > environment (ONCE_GATEWAY_*) > TOML file."""

import json
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

DEFAULT_STORE = "sqlite:///" + str(Path.home() / ".cache" / "once" / "gateway" / "responses.db")
DEFAULT_MAX_OUTPUT_TOKENS = 4096


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "smollm2-135m-instruct"  # the name clients send; resolved to a local folder
    engine_url: str | None = None  # remote `once engine` replicas; None: embedded engine
    # An OpenAI-compatible server (vLLM) fed token ids on /v1/completions instead; its
    # served model name (None: the first of its /v1/models).
    openai_url: str | None = None
    openai_model: str | None = None
    max_model_len: int | None = None  # None: the engine's (embedded) or the model's config
    max_body_bytes: int = 32 * 1024 * 1024
    # The output limit of a request that sets none (always cut to the context's room); 0:
    # up to the context. OpenAI's API caps a model's output at its own maximum, Anthropic's
    # needs a limit in every request: 4096 (the maximum output of gpt-4-turbo and the
    # Claude 3 models) keeps a model that never says eos from running to a 32k context.
    default_max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    api_keys_file: str | None = None  # None: no auth, every caller is tenant "default"
    rate_limit_storage: str = "memory://"  # or redis://host:port
    redis_timeout_s: float = 5.0  # each call to a Redis (store or rate limits), then an error
    store: str = DEFAULT_STORE  # sqlite:///path.db | memory | redis://host:port/db
    store_ttl_s: float = 30 * 24 * 3600.0  # as long as OpenAI keeps stored responses
    # A SQLite store's file size cap; past it, puts fail as on a full disk. 0: no cap.
    store_max_bytes: int = 0
    websocket_max_age_s: float = 3600.0  # then websocket_connection_limit_reached
    # A write to a client (SSE chunk, WebSocket frame) that does not complete in this long
    # ends the response, its engine request aborted, and drops the connection.
    send_timeout_s: float = 30.0
    body_timeout_s: float = 30.0  # to receive a whole request body, else 408
    verify_every: int = 32  # check 1 in N incremental prompts against a full render
    # Stateless clients' conversation states (prefix_states.py): at most this many, holding
    # at most stateless_tokens ids in all; 0 states: every stateless request renders in full.
    stateless_states: int = 512
    stateless_tokens: int = 2_000_000  # ~36 bytes an id as Python ints: ~72 MB at most
    stream_interval_s: float = 0.002  # tokens closer together than this share an event batch
    # A streamed response that has had nothing to send for this long gets a keep-alive
    # (keep_alive.py: what each API sends, and why Codex needs a real event); 0: never.
    keep_alive_s: float = 10.0
    safety: dict = field(default_factory=dict)  # one model's [safety] table; {}: off
    # [gateway.aliases]: client model name or glob -> served model; None: the defaults
    # (aliases.py), {}: none.
    aliases: dict | None = None
    # [gateway.hosted_backends.<tool>]: the MCP server serving a hosted tool type
    # (hosted/backends.py); ONCE_GATEWAY_HOSTED_BACKENDS takes the same as a JSON object.
    hosted_backends: dict = field(default_factory=dict)
    tls_certfile: str | None = None
    tls_keyfile: str | None = None

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides) -> "GatewayConfig":
        values: dict = {}
        if path is not None:
            try:
                with open(path, "rb") as f:
                    values.update(tomllib.load(f).get("gateway", {}))
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise ValueError(f"cannot read gateway config {path}: {e}") from None
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown gateway config keys in {path}: {unknown}")
        for name, spec in known.items():
            env = os.environ.get(f"ONCE_GATEWAY_{name.upper()}")
            if env is not None and name == "hosted_backends":
                try:
                    values[name] = json.loads(env)
                except ValueError as e:
                    raise ValueError(f"ONCE_GATEWAY_HOSTED_BACKENDS is not JSON: {e}") from None
            elif env is not None and name not in ("safety", "aliases"):
                values[name] = _coerce(env, spec.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _coerce(text: str, kind) -> object:
    kind = str(kind)
    if "int" in kind and "None" not in kind:
        return int(text)
    if "float" in kind:
        return float(text)
    if "int" in kind:
        return int(text) if text else None
    return text or None
