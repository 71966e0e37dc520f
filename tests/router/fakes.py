"""A ScriptedEngine that can be killed and revived, as a replica process would die."""

import asyncio

from once.engine.scripted import ScriptedEngine
from once.protocol.engine import GenerateRequest, SamplingParams
from once.protocol.errors import EngineDeadError


class KillableEngine(ScriptedEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dead = False
        self.num_generate_calls = 0

    def kill(self) -> None:
        self.dead = True
        for event in list(self._abort_events.values()):
            event.set()  # wake streams so they notice at once

    def revive(self) -> None:
        self.dead = False

    async def generate(self, request):
        self.num_generate_calls += 1
        if self.dead:
            raise EngineDeadError("connection refused")
        async for delta in super().generate(request):
            if self.dead:
                raise EngineDeadError("engine process died")
            yield delta

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("down")


class PacedPrefillEngine(KillableEngine):
    """TTFT = uncached prompt tokens / prefill_tokens_per_s, as a real prefill."""

    def __init__(self, prefill_tokens_per_s: float, **kwargs):
        super().__init__(**kwargs)
        self.prefill_tokens_per_s = prefill_tokens_per_s

    async def generate(self, request):
        prompt = request.prompt_token_ids
        uncached = len(prompt) - self._match_prefix(prompt, request.cache_salt)
        self.ttft_s = uncached / self.prefill_tokens_per_s  # read by the first step below
        async for delta in super().generate(request):
            yield delta


def make_request(request_id, prompt, *, max_tokens=4, session_key=None, forced=None):
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        session_key=session_key,
        forced_output_ids=None if forced is None else tuple(forced),
    )


async def collect(client, request):
    deltas = [delta async for delta in client.generate(request)]
    return deltas, [token for delta in deltas for token in delta.token_ids]


async def settle():
    for _ in range(3):
        await asyncio.sleep(0)
