"""The engine's HTTP API, both ends, torch-free: server.py (`build_engine_app`: any
`EngineClient` behind /v1/generate, /v1/abort, /v1/stats, /metrics; `once engine` and
`once router` serve it), client.py (`RemoteEngineClient`, the `EngineClient` over it),
metrics.py (Prometheus from an engine's `stats()`). Imports only `once.protocol` from once,
so the router and the gateway reach a remote engine without importing the engine."""
