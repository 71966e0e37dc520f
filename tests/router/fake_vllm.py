"""A fake vLLM server: `/v1/completions` with token-id prompts, streamed as vLLM does.

Backed by a ScriptedEngine (so the prefix cache and timing are real enough); served by a
real uvicorn on a free local port, so the client's streaming and cancellation are real.

With `"logprobs": k` a choice carries vLLM's completions `logprobs` object, built from the
scripted engine's fake logprobs: `tokens`, `token_logprobs`, `top_logprobs` (per token, the
sampled id first and then the top k, as one object, so k + 1 keys at most) and
`text_offset`. Tokens are named "token_id:<id>" when the request sets
`return_tokens_as_token_ids` (or in the "logprobs" id mode, a server started with
`--return-tokens-as-token-ids`); otherwise by text, which cannot be mapped back.

Disaggregated prefill, as vLLM's NIXL connector and its proxy do it: a request with
`kv_transfer_params.do_remote_decode` is answered whole (not streamed) after one token,
its KV "kept" in `kv_store` (a dict shared by the fakes of one test, standing for the
transfer), and the response carries `kv_transfer_params` with `do_remote_prefill`, the
engine id, block ids, host and port. A request bringing those params back to another
fake finds its prompt's KV there and reports the whole prompt but one token as cached;
params that match nothing are refused with a 400, as a torn transfer would fail.
`app.state.remote_prefills` lists the requests that came with KV.
"""

import contextlib
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from once.engine.scripted import ScriptedEngine
from once.gateway.testing import serve_app as serve_loopback
from once.protocol.engine import GenerateRequest, OutputConstraint, SamplingParams, TokenDelta
from once.protocol.errors import OnceError

START_TIMEOUT_S = 5
TEXT = "x"  # every token's text: one character per token


def completion_logprobs(delta: TokenDelta, k: int, as_ids: bool) -> dict:
    """vLLM's CompletionLogProbs for one delta, from the engine's TokenLogprob entries."""

    def name(token_id: int) -> str:
        return f"token_id:{token_id}" if as_ids else TEXT

    tops = []
    for entry in delta.logprobs or []:
        top = {name(entry.token_id): entry.logprob}  # vLLM puts the sampled id first
        for token_id, logprob in entry.top_logprobs[:k]:
            top.setdefault(name(token_id), logprob)
        tops.append(top)
    return {
        "text_offset": list(range(len(delta.token_ids))),
        "token_logprobs": [entry.logprob for entry in delta.logprobs or []],
        "tokens": [name(token_id) for token_id in delta.token_ids],
        "top_logprobs": tops,
    }


# vLLM's structured_outputs keys, one of which a request may set (as its validation does).
CONSTRAINT_KEYS = ("json", "json_object", "grammar", "regex", "choice", "structural_tag")


def constraint_of(structured: dict | None) -> OutputConstraint | None:
    """vLLM's structured_outputs object back as once's constraint (choice and
    structural_tag are vLLM's own and have no once kind: recorded, not enforced)."""
    if not structured:
        return None
    kinds = [key for key in CONSTRAINT_KEYS if structured.get(key) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs must set exactly one of {CONSTRAINT_KEYS}")
    kind = kinds[0]
    if kind == "json":
        schema = structured["json"]
        return OutputConstraint(
            "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
        )
    if kind == "json_object":
        return OutputConstraint("json_object")
    if kind in ("grammar", "regex"):
        return OutputConstraint("lark" if kind == "grammar" else "regex", structured[kind])
    return None


def build_fake_vllm(
    engine: ScriptedEngine,
    *,
    id_mode: str = "token_ids",
    engine_id: str = "fake-vllm",
    kv_store: dict | None = None,
) -> FastAPI:
    """id_mode: "token_ids" (return_token_ids), "logprobs" (token_id:<id> strings) or
    "text" (no ids at all, as an old server without either option)."""
    app = FastAPI()
    app.state.bodies = []
    app.state.remote_prefills = []
    kv_store = {} if kv_store is None else kv_store

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def completions(http_request: Request):
        body = await http_request.json()
        app.state.bodies.append(body)
        prompt = body["prompt"]
        if len(prompt) > engine.max_model_len:
            message = f"This model's maximum context length is {engine.max_model_len} tokens."
            return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)
        try:
            constraint = constraint_of(body.get("structured_outputs"))
        except (ValueError, TypeError, OnceError) as exc:
            message = getattr(exc, "message", str(exc))
            return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)
        request = GenerateRequest(
            request_id=f"cmpl-{len(app.state.bodies)}",
            prompt_token_ids=tuple(prompt),
            sampling=SamplingParams(
                max_tokens=body["max_tokens"],
                ignore_eos=body.get("ignore_eos", False),
                stop_token_ids=tuple(body.get("stop_token_ids") or ()),
                constraint=constraint,  # the scripted engine records and ignores it
                logprobs=body.get("logprobs"),
            ),
            cache_salt=body.get("cache_salt"),
        )

        transfer = body.get("kv_transfer_params") or {}
        remote_cached = 0
        if transfer.get("do_remote_decode"):
            return await prefill_for_remote_decode(request, transfer)
        if transfer.get("do_remote_prefill"):
            key = (transfer.get("remote_engine_id"), tuple(transfer.get("remote_block_ids") or ()))
            if kv_store.get(key) != tuple(prompt):
                message = "kv_transfer_params name no KV this server can pull"
                return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)
            app.state.remote_prefills.append(body)
            remote_cached = len(prompt) - 1

        num_logprobs = body.get("logprobs")
        as_ids = id_mode == "logprobs" or (
            id_mode != "text" and bool(body.get("return_tokens_as_token_ids"))
        )

        async def events():
            num_cached = 0
            num_output = 0
            try:
                async for delta in engine.generate(request):
                    if delta.num_cached_tokens is not None:
                        num_cached = max(delta.num_cached_tokens, remote_cached)
                    num_output += len(delta.token_ids)
                    choice = {"index": 0, "text": TEXT * len(delta.token_ids)}
                    choice["finish_reason"] = delta.finish_reason
                    if id_mode == "token_ids":
                        choice["token_ids"] = delta.token_ids
                    if num_logprobs is not None:
                        choice["logprobs"] = completion_logprobs(delta, num_logprobs, as_ids)
                    elif id_mode == "logprobs":
                        choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in delta.token_ids]}
                    chunk = {"id": request.request_id, "object": "text_completion"}
                    yield f"data: {json.dumps(chunk | {'choices': [choice]})}\n\n"
            except OnceError as exc:
                yield f"data: {json.dumps({'error': {'message': exc.message}})}\n\n"
                return
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": num_output,
                "prompt_tokens_details": {"cached_tokens": num_cached},
            }
            final = {"id": request.request_id, "choices": [], "usage": usage}
            yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def prefill_for_remote_decode(request: GenerateRequest, transfer: dict):
        ids, finish, num_cached = [], "length", 0
        async for delta in engine.generate(request):
            ids += delta.token_ids
            finish = delta.finish_reason or finish
            if delta.num_cached_tokens is not None:
                num_cached = delta.num_cached_tokens
        block_ids = list(range(len(app.state.bodies) * 1000, len(app.state.bodies) * 1000 + 4))
        kv_store[(engine_id, tuple(block_ids))] = request.prompt_token_ids
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_block_ids": block_ids,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        }
        choice = {"index": 0, "text": TEXT * len(ids), "token_ids": ids, "finish_reason": finish}
        usage = {
            "prompt_tokens": len(request.prompt_token_ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": {"cached_tokens": num_cached},
        }
        return {"id": request.request_id, "object": "text_completion", "choices": [choice],
                "usage": usage, "kv_transfer_params": params}  # fmt: skip

    return app


@contextlib.asynccontextmanager
async def serve_app(app: FastAPI):
    """Run `app` on 127.0.0.1 with an OS-chosen port; yield (base URL, server)."""
    async with serve_loopback(app, force_exit=True) as served:
        yield served
