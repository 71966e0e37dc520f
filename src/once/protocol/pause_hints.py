"""Tool pause hints on the wire: what the harness sends and the gateway reads.

The extension field is one key of the request's `metadata`, which every Responses server
stores and otherwise ignores (OpenAI's too: values are strings of up to 512 characters):

    "metadata": {"once_tool_pause_s": "{\"bash\": 3.5, \"edit\": 0.2, \"*\": 2.0}"}

a JSON object from tool name to the seconds the harness expects that tool to run (its own
running estimate), with `*` for a tool not in the table and `(reply)` for a response that
calls no tool (a text-action harness such as mini-swe-agent runs the command written in
the reply; a function-calling harness leaves it out). The harness writes it
(agent/pauses.py); the gateway reads it and tells the engine (gateway/pause_hints.py).
"""

METADATA_KEY = "once_tool_pause_s"
ANY_TOOL = "*"
TEXT_REPLY = "(reply)"
