"""The Responses API: HTTP JSON / SSE and stored responses, WebSocket mode, input items."""
