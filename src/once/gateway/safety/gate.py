"""What output a response may show while its input check runs.

A small state machine between the engine's output and the client:

    checking, holding  --verdict passes-->  passed (the held output goes out at once)
    checking, streaming --verdict passes--> passed
    checking (either)  --verdict flags-->   failed (the response ends with content_filter;
                                            under `hold` the output is dropped unseen)

Under the `hold` policy output waits in the gate until the verdict; under `stream` it flows
while the check runs. A response with no check is passed from the start.
"""

import asyncio
from collections.abc import Callable

from once.gateway.output import OutputEvent
from once.gateway.safety.checker import SafetyVerdict


class SafetyGate:
    def __init__(
        self,
        check: "asyncio.Task[SafetyVerdict] | None",
        hold: bool,
        on_verdict: Callable[[SafetyVerdict], None],
    ):
        self.check = check  # None once the verdict is in (or when there is no check)
        self.holding = hold and check is not None
        self.held: list[OutputEvent] = []
        self.on_verdict = on_verdict
        self.failed = False
        self.output_dropped = False  # failed while holding output nobody saw

    def verdict_ready(self) -> bool:
        return self.check is not None and self.check.done()

    def admit(self, events: list[OutputEvent]) -> list[OutputEvent]:
        """What of `events` goes out now: all of them, or none while holding."""
        if self.holding:
            self.held.extend(events)
            return []
        return events

    async def settle(self) -> list[OutputEvent]:
        """Wait for the verdict (if one is still due) and return the held output it
        releases; on a flagged input, `failed` is set and nothing is released."""
        if self.check is None:
            return []
        verdict = await self.check
        self.check = None
        self.on_verdict(verdict)
        released, self.held = self.held, []
        if verdict.flagged:
            self.failed = True
            self.output_dropped = bool(released) and self.holding
            return []
        self.holding = False
        return released
