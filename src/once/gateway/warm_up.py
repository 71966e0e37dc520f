"""The warm-up (`generate: false`, WebSocket mode): prefill the prompt, produce nothing.

The engine computes the prompt (a one-token request whose token is dropped), so its KV is
in the prefix cache when the real request arrives; the input check runs beside it, since
the warm-up's items join the chain and continuations check only their own. The response
has no output: `completed` with zero output tokens, or `content_filter` when the check
fails (and the prefill is aborted), or `failed` when the engine fails.
"""

import asyncio
import time
from collections.abc import AsyncIterator

from once.gateway.metrics import GatewayMetrics
from once.gateway.output import COMPLETED, FAILED, INCOMPLETE, OutputEvent, Usage
from once.gateway.prepare import Prepared
from once.gateway.validation import safety_texts
from once.protocol.engine import FINISH_ERROR, EngineClient, GenerateRequest, SamplingParams
from once.protocol.errors import OnceError


async def warm_up_events(
    engine: EngineClient, prepared: Prepared, sampling: SamplingParams, metrics: GatewayMetrics
) -> AsyncIterator[list[OutputEvent]]:
    output, model = prepared.output, prepared.model
    num_prompt = len(prepared.built.prompt_ids)
    yield output.started()
    if not num_prompt:  # nothing to prefill
        yield output.finish(COMPLETED, Usage(0, 0, 0))
        return
    request = GenerateRequest(
        request_id=prepared.response_id,
        prompt_token_ids=tuple(prepared.built.prompt_ids),
        sampling=sampling,
        session_key=prepared.request.prompt_cache_key,
        cache_salt=prepared.tenant.name,
    )
    started = time.perf_counter()
    prefill = asyncio.create_task(_prefill(engine, request))
    try:
        if model.safety is not None:
            verdict = await model.safety.check(safety_texts(prepared.new_items))
            metrics.record_safety(verdict, None, started)
            if verdict.flagged:
                metrics.content_filtered.inc()
                yield output.finish(INCOMPLETE, Usage(num_prompt, 0, 0), reason="content_filter")
                return
        num_cached = await prefill
    except OnceError as e:
        metrics.failed.inc()
        error = {"code": e.code, "message": e.message}
        yield output.finish(FAILED, Usage(num_prompt, 0, 0), error=error)
        return
    finally:
        if not prefill.done():
            prefill.cancel()
            await engine.abort(request.request_id)
    usage = Usage(num_prompt, num_cached, 0)
    metrics.record_usage(usage)
    yield output.finish(COMPLETED, usage)


async def _prefill(engine: EngineClient, request: GenerateRequest) -> int:
    """Run the one-token request to its end; the number of prompt tokens found cached."""
    num_cached = 0
    try:
        async for delta in engine.generate(request):
            if delta.num_cached_tokens is not None:
                num_cached = delta.num_cached_tokens
            if delta.finished and delta.finish_reason == FINISH_ERROR:
                error = delta.error or {}
                raise OnceError(error.get("message", "the engine failed this request"))
    except OnceError:
        raise
    except Exception as e:  # noqa: BLE001 - a failed engine fails this response only
        raise OnceError(f"the engine failed: {e!r}") from e
    return num_cached
