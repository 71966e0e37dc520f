"""The WebSocket transport's chain: which response the next request continues from."""

import asyncio

from once.agent.transport.websocket import WebSocketTransport


class RecordingTransport(WebSocketTransport):
    """The real chain logic; the socket replaced by scripted answers."""

    def __init__(self, answers):
        super().__init__(client=None, http_fallback=False)
        self.answers = list(answers)
        self.payloads = []

    async def _over_websocket(self, payload, request, on_event):
        self.payloads.append(payload)
        return self.answers.pop(0)


def _message(text):
    return {"type": "message", "role": "user", "content": text}


def _answer(response_id, status="completed"):
    output = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}
    ]
    return {"id": response_id, "status": status, "output": output if status == "completed" else []}


def test_a_failed_response_does_not_advance_the_chain():
    transport = RecordingTransport([_answer("r1"), _answer("r2", "failed"), _answer("r3")])
    first = {"model": "m", "input": [_message("a")]}

    async def run():
        first_response = await transport.create(first)
        second = {
            "model": "m",
            "input": [*first["input"], *first_response["output"], _message("b")],
        }
        await transport.create(second)  # fails: nothing stored on the server
        await transport.create(second)  # the retry continues from r1, with only the new item

    asyncio.run(run())
    retry = transport.payloads[2]
    assert retry["previous_response_id"] == "r1"
    assert retry["input"] == [_message("b")]
