"""Chat Completions transport: the loop's full request as chat messages, every call, over
the `openai` SDK's streaming `chat.completions` (what mini-swe-agent, aider, smolagents
and LiteLLM-based agents speak). The reply comes back as Responses output items.
"""

import openai
from openai import AsyncOpenAI

from once.agent.transport.base import EventCallback, TransportError, TransportStats
from once.agent.transport.convert import chat_request, output_items, response_dict


class ChatCompletionsTransport:
    def __init__(self, client: AsyncOpenAI):
        self.client = client
        self.stats = TransportStats()

    async def create(self, request: dict, on_event: EventCallback | None = None) -> dict:
        body = chat_request(request)
        self.stats.calls += 1
        self.stats.count_sent(body)
        emit = on_event or (lambda event: None)
        text, usage = "", None
        calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
        try:
            stream = await self.client.chat.completions.create(
                **body, stream=True, stream_options={"include_usage": True}
            )
            async with stream:
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for choice in chunk.choices:
                        delta = choice.delta
                        if delta.content:
                            text += delta.content
                            emit({"type": "response.output_text.delta", "delta": delta.content})
                        elif not delta.tool_calls:
                            emit({"type": "response.created"})
                        for call in delta.tool_calls or ():
                            entry = calls.setdefault(call.index, ["", "", ""])
                            entry[0] = call.id or entry[0]
                            if call.function is not None:
                                entry[1] += call.function.name or ""
                                entry[2] += call.function.arguments or ""
                            emit({"type": "response.function_call_arguments.delta"})
        except openai.APIStatusError as e:
            code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
            raise TransportError(e.message, code, 0, from_server=True) from e
        except openai.APIError as e:  # an error chunk mid-stream
            body_code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
            raise TransportError(e.message, body_code or getattr(e, "code", None), 1) from e
        ordered = [(calls[i][0], calls[i][1], calls[i][2]) for i in sorted(calls)]
        return response_dict(output_items(text, ordered), _usage(usage))

    async def close(self) -> None:
        return None


def _usage(usage) -> dict:
    if usage is None:
        return {}
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "input_tokens_details": {"cached_tokens": cached},
    }
