"""The gateway: OpenAI Responses, Chat Completions and Anthropic Messages over one pipeline.

pipeline.py (admit -> prepare -> stream) sits at the top; each API's front end and event
encoder is in apis/<api>/, with its request adapter in once.protocol; front/ holds what
the front ends share (body reads, SSE, keep-alives, OpenAPI), admission/ the checks before
a response starts (keys, limits, CPU cost), prompt/ items -> prompt ids, state/ the stored
and kept conversations, hosted/ the tools the gateway runs itself, safety/ the input
classifiers.
"""
