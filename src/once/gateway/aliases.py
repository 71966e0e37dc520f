"""Model names clients send, mapped to the models this gateway serves.

Real clients send their own model names: Claude Code its main and small/fast Claude
models, Codex its default GPT model. A table maps each name, exactly or by a glob
pattern (`fnmatch`: `claude-*`), to a served model; a served model's own name always
wins, then exact aliases, then patterns in the table's order. With no table configured,
a gateway serving one model maps the names those clients send by default to it (exact
names only, so any other unknown model is still `model_not_found`, as OpenAI answers);
an empty table turns aliasing off. Responses echo the name the client sent.
"""

import fnmatch
from collections.abc import Mapping

# The models Codex CLI 0.171 and Claude Code 2.1 ask for in their default configurations
# (Codex's default; Claude Code's main model and its opus/sonnet/haiku choices).
DEFAULT_CLIENT_MODELS: tuple[str, ...] = (
    "gpt-6.2-sol",
    "claude-opus-4-8",
    "claude-sonnet-5",
    "claude-haiku-4-5-20251001",
)


def default_table(served: str) -> dict[str, str]:
    return {name: served for name in DEFAULT_CLIENT_MODELS}


class ModelAliases:
    def __init__(self, served: Mapping[str, object], table: Mapping[str, str] | None = None):
        if table is None:
            only = next(iter(served)) if len(served) == 1 else None
            table = default_table(only) if only else {}
        unknown = sorted({target for target in table.values() if target not in served})
        if unknown:
            raise ValueError(f"model aliases point at models not served here: {unknown}")
        self.served = served
        self.exact = {name: target for name, target in table.items() if not _is_pattern(name)}
        self.patterns = [(name, target) for name, target in table.items() if _is_pattern(name)]

    def resolve(self, name: str) -> str | None:
        """The served model `name` stands for, or None."""
        if name in self.served:
            return name
        if name in self.exact:
            return self.exact[name]
        for pattern, target in self.patterns:
            if fnmatch.fnmatchcase(name, pattern):
                return target
        return None

    def by_served(self) -> dict[str, list[str]]:
        """Each served model's aliases (exact names, then patterns), for /v1/models."""
        table: dict[str, list[str]] = {}
        for name, target in [*sorted(self.exact.items()), *self.patterns]:
            table.setdefault(target, []).append(name)
        return table


def _is_pattern(name: str) -> bool:
    return any(char in name for char in "*?[")
