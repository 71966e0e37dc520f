"""`EngineClient` over an OpenAI-compatible `/v1/completions` server (vLLM, SGLang).

The prompt goes as token ids (`"prompt": [ids]`, accepted by both), streamed with
`stream_options.include_usage`. Output token ids are read from, in order of preference:
- `choices[0].token_ids` (vLLM with `"return_token_ids": true`, sent on every request);
- `choices[0].logprobs.tokens` as `"token_id:<id>"` strings (vLLM with
  `--return-tokens-as-token-ids` and `logprobs: 0`, older versions);
a chunk with text but no ids is a protocol error (the router cannot continue a
conversation from text it would have to re-tokenize). Cached prompt tokens come from the
final usage chunk, `usage.prompt_tokens_details.cached_tokens` (vLLM with
`--enable-prompt-tokens-details`; SGLang reports it by default), so `num_cached_tokens`
arrives on the LAST delta here, not the first.

`prompt_text` (ids -> text) sends the prompt as text instead, for what takes no ids
(sglang-router in front of vLLM); the server then tokenizes it again.

`forced_output_ids` cannot be forced through this API: the replica is asked for exactly
that many tokens with `ignore_eos`, so the cost matches the recording but the ids are
the server's own.

A constraint goes as vLLM's `structured_outputs` object (vLLM >= 0.10.2, the version
`return_token_ids` needs already; the older `guided_json` / `guided_grammar` /
`guided_regex` fields were removed in 0.12): `json` (the schema), `json_object`,
`grammar` (Lark; an llguidance `{"grammars": [...]}` document, such as a forced tool
call's, goes as its one Lark grammar; vLLM's guidance backend reads llguidance's Lark
dialect as it is, so a fleet starts vLLM with `--structured-outputs-config '{"backend":
"guidance"}'`, the library once's engine enforces them with) or `regex`. JSON kinds
add `disable_any_whitespace`, as once's engine compiles JSON
without free whitespace (engine/grammar.py). A forced request sends no constraint: forced
ids bypass it in once's engine too. SGLang names these fields differently (`json_schema`,
`regex`, `ebnf`) and is not mapped.

Logprobs (`SamplingParams.logprobs` = k) go as `"logprobs": k` with
`"return_tokens_as_token_ids": true` (a vLLM request field), so each chunk's
`choices[0].logprobs` names ids rather than text: `tokens` as "token_id:<id>",
`token_logprobs` (one float per token) and `top_logprobs` (per token, an object from
"token_id:<id>" to logprob holding the k most likely ids and the sampled one: k + 1 keys
when the sampled id ranks below k, one key for k = 0). They become one `TokenLogprob` per
output id, the alternatives ordered by logprob and cut to k (`logprobs_of`). Text keys
cannot be mapped back to ids (two ids may decode alike), so a replica that sends them is
a protocol error. vLLM reports the raw distribution by default (`logprobs_mode
"raw_logprobs"`), as once's engine does, and clamps -inf to -9999.0, kept as sent.
"""

import json
import time
from collections.abc import AsyncIterator, Callable

import httpx

from once.engine_http.client import DEFAULT_TIMEOUT
from once.protocol.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerateRequest,
    OutputConstraint,
    RequestMetrics,
    TokenDelta,
    TokenLogprob,
)
from once.protocol.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    OnceError,
)
from once.router.replicas import ServerLoad
from once.router.vllm_metrics import VllmMetrics, parse_vllm_metrics

TOKEN_ID_PREFIX = "token_id:"
# ids -> text, for a server in front of the replica that takes no token ids (sglang-router)
PromptText = Callable[[list[int]], str]


def completions_body(
    request: GenerateRequest, model: str, prompt_text: PromptText | None = None
) -> dict:
    sampling = request.sampling
    ids = list(request.prompt_token_ids)
    body = {
        "model": model,
        "prompt": ids if prompt_text is None else prompt_text(ids),
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        # vLLM/SGLang extensions to the OpenAI schema:
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "skip_special_tokens": False,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt  # vLLM >= 0.9: salts the first block hash
    if request.forced_output_ids is not None:
        body["max_tokens"] = max(1, len(request.forced_output_ids))
        body["ignore_eos"] = True
    elif sampling.constraint is not None:
        body["structured_outputs"] = structured_outputs(sampling.constraint)
    if sampling.logprobs is not None:
        body["logprobs"] = sampling.logprobs
        body["return_tokens_as_token_ids"] = True  # ids, not text, in the logprobs
    if request.kv_transfer_params is not None:
        body["kv_transfer_params"] = request.kv_transfer_params
        if is_prefill_leg(request):
            # vLLM returns the decode side's params in the whole response: not streamed.
            body["stream"] = False
            del body["stream_options"]
    return body


def is_prefill_leg(request: GenerateRequest) -> bool:
    return bool((request.kv_transfer_params or {}).get("do_remote_decode"))


def structured_outputs(constraint: OutputConstraint) -> dict:
    """vLLM's `structured_outputs` request field for a constraint."""
    if constraint.kind == "json_schema":
        return {"json": json.loads(constraint.text), "disable_any_whitespace": True}
    if constraint.kind == "json_object":
        return {"json_object": True, "disable_any_whitespace": True}
    if constraint.kind == "lark":
        return {"grammar": constraint.text}
    if constraint.kind == "llguidance":
        return {"grammar": _single_lark(constraint.text)}
    return {"regex": constraint.text}


def _single_lark(document: str) -> str:
    """The Lark text of an llguidance document holding one Lark grammar (what the gateway
    builds for tool calls): vLLM takes Lark (llguidance's dialect, `%json` included) but
    not the document format."""
    grammars = json.loads(document).get("grammars") or []
    if len(grammars) != 1 or not isinstance(grammars[0].get("lark_grammar"), str):
        raise InvalidRequestError(
            "only single-Lark llguidance grammars can be sent to an OpenAI-compatible replica",
            param="constraint",
        )
    return grammars[0]["lark_grammar"]


def error_from_status(status_code: int, body: bytes) -> OnceError:
    """vLLM/SGLang error bodies (`{"error": {"message": ...}}` or `{"message": ...}`) by
    status: 400 is the request's fault, 429/503 an overloaded replica, other 5xx dead."""
    try:
        data = json.loads(body)
        error = data.get("error", data) if isinstance(data, dict) else {}
        message = error.get("message") if isinstance(error, dict) else str(error)
    except ValueError:
        message = None
    message = message or body[:200].decode(errors="replace")
    if status_code in (400, 404, 413, 422):
        return InvalidRequestError(f"replica rejected the request: {message}")
    if status_code in (429, 503):
        return EngineOverloadedError(f"replica overloaded ({status_code}): {message}")
    if status_code >= 500:
        return EngineDeadError(f"replica failed ({status_code}): {message}")
    return OnceError(f"replica answered {status_code}: {message}")


def token_ids_of(choice: dict) -> list[int]:
    ids = choice.get("token_ids")
    if ids is not None:
        return [int(token_id) for token_id in ids]
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if tokens is not None:
        if not all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
            raise OnceError("replica sent logprob tokens that are not 'token_id:<id>'")
        return [int(t[len(TOKEN_ID_PREFIX) :]) for t in tokens]
    if choice.get("text"):
        raise OnceError(
            "replica streamed text without token ids; start vLLM >= 0.10.2 (return_token_ids)"
            " or with --return-tokens-as-token-ids"
        )
    return []


def _token_id_of(key) -> int:
    if not (isinstance(key, str) and key.startswith(TOKEN_ID_PREFIX)):
        raise OnceError(
            "replica sent top logprobs keyed by text, not 'token_id:<id>'; a vLLM that "
            "ignores return_tokens_as_token_ids can be started with --return-tokens-as-token-ids"
        )
    return int(key[len(TOKEN_ID_PREFIX) :])


def logprobs_of(choice: dict, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """A chunk's vLLM `logprobs` as one TokenLogprob per id of `token_ids`."""
    data = choice.get("logprobs") or {}
    values = data.get("token_logprobs")
    if values is None or len(values) != len(token_ids) or None in values:
        raise OnceError("replica sent no logprob for some of its tokens")
    tops = data.get("top_logprobs") or [None] * len(token_ids)
    if len(tops) != len(token_ids):
        raise OnceError("replica sent top logprobs for a different number of tokens")
    entries = []
    for token_id, value, top in zip(token_ids, values, tops, strict=True):
        alternatives = [(_token_id_of(key), float(lp)) for key, lp in (top or {}).items()]
        alternatives.sort(key=lambda pair: -pair[1])  # stable: vLLM's order breaks ties
        entries.append(TokenLogprob(token_id, float(value), tuple(alternatives[:k])))
    return entries


def served_model(base_url: str, name: str | None = None) -> tuple[str, int | None]:
    """(served model name, its context length) from the server's /v1/models: the entry
    named `name`, or the first one. vLLM reports `max_model_len` there."""
    try:
        reply = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=60.0)
        reply.raise_for_status()
        models = reply.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise OnceError(f"cannot list the models of {base_url}: {exc}") from exc
    for entry in models:
        if name is None or entry.get("id") == name:
            length = entry.get("max_model_len")
            return str(entry.get("id")), int(length) if length else None
    served = [entry.get("id") for entry in models]
    raise OnceError(f"{base_url} serves {served}, not {name!r}")


class OpenAICompletionsClient:
    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
        prompt_text: PromptText | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.prompt_text = prompt_text
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, transport=transport, headers=headers
        )
        self._open: dict[str, httpx.Response] = {}
        self._counters = {"num_requests_finished": 0, "num_prompt_tokens": 0}
        self._counters |= {"num_cached_prompt_tokens": 0, "num_generated_tokens": 0}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        arrival = time.monotonic()
        first_token_at: float | None = None
        num_output = 0
        finish_reason: str | None = None
        usage: dict = {}
        num_logprobs = request.sampling.logprobs
        if is_prefill_leg(request):
            yield await self._prefill_leg(request, arrival)
            return
        try:
            async with self._http.stream(
                "POST",
                "/v1/completions",
                json=completions_body(request, self.model, self.prompt_text),
            ) as response:
                if response.status_code != 200:
                    raise error_from_status(response.status_code, await response.aread())
                self._open[request.request_id] = response
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    chunk = self._parse(data)
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        ids = token_ids_of(choice)
                        finish_reason = choice.get("finish_reason") or finish_reason
                        if ids:
                            first_token_at = first_token_at or time.monotonic()
                            num_output += len(ids)
                            delta = TokenDelta(request.request_id, ids)
                            if num_logprobs is not None:
                                delta.logprobs = logprobs_of(choice, ids, num_logprobs)
                            yield delta
        except httpx.TransportError as exc:
            raise EngineDeadError(f"lost the replica at {self.base_url}: {exc!r}") from exc
        finally:
            self._open.pop(request.request_id, None)
        if finish_reason is None:
            raise EngineDeadError(
                f"replica at {self.base_url} ended the stream of {request.request_id} "
                "without a finish reason"
            )
        yield self._last_delta(request, finish_reason, usage, num_output, arrival, first_token_at)

    async def _prefill_leg(self, request: GenerateRequest, arrival: float) -> TokenDelta:
        """Disaggregated prefill (vLLM's proxy protocol): one non-streamed call whose
        response carries `kv_transfer_params` for the decode replica; one last delta."""
        try:
            response = await self._http.post(
                "/v1/completions", json=completions_body(request, self.model, self.prompt_text)
            )
        except httpx.TransportError as exc:
            raise EngineDeadError(f"lost the replica at {self.base_url}: {exc!r}") from exc
        if response.status_code != 200:
            raise error_from_status(response.status_code, response.content)
        data = self._parse(response.text)
        choices = data.get("choices") or [{}]
        ids = token_ids_of(choices[0])
        finish = choices[0].get("finish_reason") or "length"
        first_token_at = time.monotonic()
        delta = self._last_delta(
            request, finish, data.get("usage") or {}, len(ids), arrival, first_token_at
        )
        delta.token_ids = ids
        params = data.get("kv_transfer_params")
        delta.kv_transfer_params = params if isinstance(params, dict) else None
        return delta

    async def abort(self, request_id: str) -> None:
        # OpenAI servers abort a request when its stream is closed.
        response = self._open.pop(request_id, None)
        if response is not None:
            await response.aclose()

    async def stats(self) -> dict:
        return {"num_running": len(self._open), **self._counters}

    async def check_health(self) -> None:
        try:
            response = await self._http.get("/health")
        except httpx.TransportError as exc:
            raise EngineDeadError(f"cannot reach the replica at {self.base_url}: {exc}") from exc
        if response.status_code != 200:
            raise EngineDeadError(f"replica at {self.base_url} health: {response.status_code}")

    async def metrics(self) -> VllmMetrics:
        """The server's own `/metrics` (vLLM's names; SGLang's are not mapped)."""
        try:
            response = await self._http.get("/metrics")
        except httpx.TransportError as exc:
            raise EngineDeadError(f"cannot reach the replica at {self.base_url}: {exc}") from exc
        if response.status_code != 200:
            raise error_from_status(response.status_code, response.content)
        return parse_vllm_metrics(response.text)

    async def server_load(self) -> ServerLoad:
        metrics = await self.metrics()
        return ServerLoad(metrics.num_running, metrics.num_waiting, metrics.kv_cache_usage)

    async def aclose(self) -> None:
        await self._http.aclose()

    def _parse(self, data: str) -> dict:
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise OnceError(f"replica sent a malformed chunk: {data[:200]!r}") from exc
        if "error" in chunk:  # vLLM reports a request it cannot serve mid-stream too
            error = chunk["error"]
            code = error.get("code") if isinstance(error, dict) else None
            status = code if isinstance(code, int) else 500
            raise error_from_status(status, json.dumps(chunk).encode())
        return chunk

    def _last_delta(self, request, finish_reason, usage, num_output, arrival, first_token_at):
        num_prompt = int(usage.get("prompt_tokens") or len(request.prompt_token_ids))
        details = usage.get("prompt_tokens_details") or {}
        num_cached = int(details.get("cached_tokens") or 0)
        now = time.monotonic()
        counters = self._counters
        counters["num_requests_finished"] += 1
        counters["num_prompt_tokens"] += num_prompt
        counters["num_cached_prompt_tokens"] += num_cached
        counters["num_generated_tokens"] += num_output
        ttft = (first_token_at or now) - arrival
        metrics = RequestMetrics(
            num_prompt_tokens=num_prompt,
            num_cached_tokens=num_cached,
            num_computed_tokens=num_prompt - num_cached,
            num_output_tokens=num_output,
            ttft_s=ttft,
            mean_token_latency_s=(now - arrival - ttft) / max(1, num_output - 1),
            e2e_s=now - arrival,
        )
        reason = FINISH_STOP if finish_reason == "stop" else FINISH_LENGTH
        if finish_reason not in ("stop", "length"):
            reason = finish_reason
        return TokenDelta(
            request.request_id, [], reason, num_cached_tokens=num_cached, metrics=metrics
        )
