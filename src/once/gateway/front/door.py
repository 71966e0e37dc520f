"""What the front ends hold besides the pipeline: the caller's key check, the stored
responses (GET and DELETE by id, a WebSocket's `previous_response_id`), the transport's
own counters, and its bounds (body size, a write's and a body's deadlines, a WebSocket's
age). The app builds one door from the gateway's parts and its config; a front end never
reaches through the pipeline for them.
"""

from dataclasses import dataclass

from once.gateway.admission.auth import KeyRing
from once.gateway.config import GatewayConfig
from once.gateway.metrics import GatewayMetrics
from once.gateway.pipeline import GatewayParts, ResponsePipeline
from once.gateway.state.store import ResponseStore


@dataclass(frozen=True)
class FrontDoor:
    pipeline: ResponsePipeline
    keyring: KeyRing
    store: ResponseStore
    metrics: GatewayMetrics
    max_body_bytes: int
    send_timeout_s: float
    body_timeout_s: float
    websocket_max_age_s: float

    @classmethod
    def build(
        cls, pipeline: ResponsePipeline, parts: GatewayParts, config: GatewayConfig
    ) -> "FrontDoor":
        return cls(
            pipeline,
            parts.keyring,
            parts.store,
            parts.metrics,
            config.max_body_bytes,
            config.send_timeout_s,
            config.body_timeout_s,
            config.websocket_max_age_s,
        )
