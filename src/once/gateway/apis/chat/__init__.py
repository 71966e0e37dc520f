"""Chat Completions: the front end and the chunk encoder (adapter: protocol/chat.py)."""
