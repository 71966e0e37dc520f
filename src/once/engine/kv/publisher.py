"""KV events on the wire vLLM uses: a ZMQ PUB socket, msgpack payloads.

`once engine --kv-events-endpoint tcp://127.0.0.1:5557` publishes its prefix cache's
BlockStored / BlockRemoved / AllBlocksCleared events exactly as a vLLM server started
with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`
does, so one subscriber (`router/index.py: zmq_event_subscriber`) keeps an exact prefix
index for either kind of replica.

Wire format (vllm/distributed/kv_events.py): multipart frames `[topic, seq, payload]`,
seq an 8-byte big-endian counter, payload the msgpack of a `KVEventBatch` encoded by
msgspec with `array_like=True, tag=True`: `[ts, [event, ...]]`, each event `[tag,
*fields in declaration order]`. Events are published after each engine step that made
any; a subscriber that joins late misses what came before (ZMQ PUB/SUB drops), as with
vLLM, so a router treats a new subscription as an empty index.
"""

import time

from once.protocol.kv_blocks import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def encode_event(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        return [
            "BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids,
            event.block_size, event.lora_id, event.medium,
        ]  # fmt: skip
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(events: list[KVEvent], ts: float | None = None) -> bytes:
    import msgpack

    return msgpack.packb([time.time() if ts is None else ts, [encode_event(e) for e in events]])


class ZmqKVEventPublisher:
    def __init__(self, endpoint: str, topic: str = "kv-events"):
        import zmq

        self._context: zmq.SyncContext = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.seq = 0

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        self._socket.send_multipart(
            [self.topic, self.seq.to_bytes(8, "big"), encode_batch(events)], copy=False
        )
        self.seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)
