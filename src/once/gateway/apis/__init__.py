"""One folder per API: its HTTP front end (http.py) and event encoder (events.py); the
request adapters are once.protocol.responses, .chat and .messages."""
