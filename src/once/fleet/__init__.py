"""once in front of live vLLM servers: starting them, reading their metrics, the fleet command."""
