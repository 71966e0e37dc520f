"""Conversations across requests: the response store, kept prefix states, connections."""
