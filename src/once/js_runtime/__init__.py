"""JavaScript programs in a fresh V8 isolate each, for every layer that runs them.

The harness's Code Mode (agent/tools/code_mode.py) and the gateway's programmatic tool
calling (gateway/hosted/programs.py) both run a model's program here: `ProgramRun` (runner.py)
is the bridge between V8 (mini-racer) and asyncio with its limits, `PRELUDE`
(prelude.py) the globals a program sees, `tool_signature` (signatures.py) the one-line
TypeScript-like signatures tool descriptions list. Torch-free, and importing neither the
harness nor the gateway.
"""
