"""Anthropic Messages: the front end and the event encoder (adapter: protocol/messages.py)."""
