"""The connector lifecycle the engine drives (kv/connector.py): a recording connector sees
each request arrive, be admitted, have its steps' blocks computed and finish, in that
order; what it returns is what the engine runs and what the last delta carries."""

from dataclasses import replace

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.kv.memory_connector import HostMemoryConnector
from once.protocol.engine import GenerateRequest
from tests.engine.test_engine_parity import GREEDY, prompts


class RecordingConnector(HostMemoryConnector):
    role = "recording"

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def on_arrival(self, request):
        self.calls.append(("arrival", request.request_id))
        return replace(request, sampling=replace(request.sampling, max_tokens=2))

    def on_admit(self, request, kv_transfer_params):
        self.calls.append(("admit", request.request_id))
        assert kv_transfer_params == {"do_remote_prefill": False}

    def after_forward(self, scheduled):
        super().after_forward(scheduled)  # saves the blocks the step made whole
        self.calls += [("forward", item.request.request_id) for item in scheduled]

    def on_finish(self, request):
        self.calls.append(("finish", request.request_id))
        return {"finished": request.request_id}

    def stats(self):
        return {"recording_calls": len(self.calls)}


def test_the_engine_meets_its_connector_at_the_lifecycle_calls(tiny_model_dir):
    connector = RecordingConnector()
    config = EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=64)
    engine = LLMEngine(config, connector=connector)
    request = GenerateRequest(
        "a", tuple(prompts(3, [10])[0]), GREEDY, kv_transfer_params={"do_remote_prefill": False}
    )
    deltas = engine.generate([request])["a"]

    # One prefill step (which samples the first token), one decode step for the second.
    assert connector.calls == [
        ("arrival", "a"),
        ("admit", "a"),
        ("forward", "a"),
        ("forward", "a"),
        ("finish", "a"),
    ]
    assert sum(len(d.token_ids) for d in deltas) == 2  # the request as on_arrival made it
    assert deltas[-1].kv_transfer_params == {"finished": "a"}
    assert connector.num_saved == 2  # the two full blocks of the 11 tokens computed
    stats = engine.stats()
    assert stats["role"] == "recording" and stats["recording_calls"] == 5
