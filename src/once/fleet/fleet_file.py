"""A fleet file: the gateway, the router and N vLLM replicas that `once fleet up` runs.

    model = "smollm2-135m-instruct"   # a model name, a Hugging Face folder or a .gguf file
    [gateway]                         # `once serve`: what clients connect to
    port = 8000
    [router]                          # `once router` over the replicas
    policy = "once"
    [vllm]                            # every replica's settings...
    count = 2
    kv_cache_mib = 512
    [[vllm.replica]]                  # ...and, optionally, one table per replica overriding them
    port = 8101

Every key is optional (examples/vllm-fleet.toml lists them all with their defaults). A
port of 0 is any free port, chosen when the fleet starts; relative paths are relative to
the fleet file. Read with tomllib into one frozen `FleetFile`; a bad file is one
`FleetFileError` line naming the table and key.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from once.model_files import DEFAULT_MODEL
from once.router.policies import POLICIES, make_policy

SAFETY_POLICIES = ("stream", "hold", "off")  # `once serve --safety-policy`, or --no-safety
STORE_FORMS = ("memory", "sqlite:///", "redis://", "rediss://", "unix://")  # open_store's
RATE_LIMIT_FORMS = ("memory://", "redis://", "rediss://", "unix://")


class FleetFileError(ValueError):
    """A fleet file that cannot be run; the message names the file, table and key."""


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    store: str | None = None  # None: the gateway's own default (a SQLite file)
    rate_limit_storage: str | None = None  # None: in memory
    safety: str = "stream"  # as `once serve`; "off" is --no-safety
    api_keys: Path | None = None


@dataclass(frozen=True)
class RouterSettings:
    port: int = 0
    policy: str = "once"
    policy_params: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplicaSettings:
    port: int = 0
    kv_cache_mib: int = 512
    threads: int = 0  # OpenMP threads; 0: this machine's cores shared among the replicas
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32
    max_model_len: int = 4096
    prefix_caching: bool = True
    kv_events: bool = True
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags, as they are


@dataclass(frozen=True)
class FleetFile:
    path: Path
    model: str  # as `once serve --model` takes it: a name, or an absolute folder or .gguf
    served_model_name: str  # what clients send and vLLM serves
    gateway: GatewaySettings
    router: RouterSettings
    replicas: tuple[ReplicaSettings, ...]

    @property
    def max_model_len(self) -> int:  # the gateway's: every replica must hold a request
        return min(replica.max_model_len for replica in self.replicas)

    @property
    def block_size(self) -> int:
        return self.replicas[0].block_size


REPLICA_KEYS = ("port", "kv_cache_mib", "threads", "block_size", "max_model_len",
                "prefix_caching", "kv_events", "extra_args")  # fmt: skip


def load_fleet_file(path: str | Path) -> FleetFile:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except OSError as exc:
        raise FleetFileError(f"cannot read fleet file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise FleetFileError(f"{path}: not valid TOML: {exc}") from None
    return parse_fleet(values, path)


def parse_fleet(values: dict[str, Any], path: Path) -> FleetFile:
    top = _Table(values, path, "")
    model = top.text("model", DEFAULT_MODEL)
    model = _model_argument(model, path.parent)
    served = top.text("served_model_name", _served_name(model))
    gateway, router, vllm = top.table("gateway"), top.table("router"), top.table("vllm")
    top.finish()
    fleet = FleetFile(path, model, served, _gateway(gateway), _router(router), _replicas(vllm))
    _check_ports(fleet, path)
    return fleet


def _gateway(table: _Table) -> GatewaySettings:
    settings = GatewaySettings(
        host=table.text("host", GatewaySettings.host),
        port=table.port("port", GatewaySettings.port),
        store=table.url("store", STORE_FORMS, (".db", ".sqlite", ".sqlite3")),
        rate_limit_storage=table.url("rate_limit_storage", RATE_LIMIT_FORMS),
        safety=table.text("safety", GatewaySettings.safety, choices=SAFETY_POLICIES),
        api_keys=table.file("api_keys"),
    )
    table.finish()
    return settings


def _router(table: _Table) -> RouterSettings:
    policy = table.text("policy", RouterSettings.policy, choices=tuple(sorted(POLICIES)))
    params_table = table.table("policy_params")
    params = {key: params_table.number(key) for key in list(params_table.values)}
    try:
        make_policy(policy, **params)
    except ValueError as exc:
        raise table.error("policy_params", str(exc)) from None
    settings = RouterSettings(table.port("port", RouterSettings.port), policy, params)
    table.finish()
    return settings


def _replicas(table: _Table) -> tuple[ReplicaSettings, ...]:
    entries = table.tables("replica")
    count = table.integer("count", len(entries) or 1, minimum=1)
    if entries and count != len(entries):
        raise table.error("count", f"{count} does not match the {len(entries)} [[vllm.replica]]")
    if count > 1 and table.values.get("port"):
        raise table.error("port", "give each replica its own port in [[vllm.replica]]")
    defaults = _replica(table, ReplicaSettings())
    table.finish()
    replicas = []
    for i in range(count):
        entry = entries[i] if entries else _Table({}, table.source, "vllm.replica")
        replicas.append(_replica(entry, defaults))
        entry.finish()
    if any(replica.threads == 0 for replica in replicas):
        share = max(1, len(os.sched_getaffinity(0)) // count)
        replicas = [r if r.threads else replace(r, threads=share) for r in replicas]
    sizes = sorted({replica.block_size for replica in replicas})
    if len(sizes) > 1:
        raise table.error("block_size", f"replicas differ ({sizes}); the router needs one size")
    return tuple(replicas)


def _replica(table: _Table, defaults: ReplicaSettings) -> ReplicaSettings:
    return ReplicaSettings(
        port=table.port("port", defaults.port),
        kv_cache_mib=table.integer("kv_cache_mib", defaults.kv_cache_mib, minimum=1),
        threads=table.integer("threads", defaults.threads, minimum=0),
        block_size=table.integer("block_size", defaults.block_size, minimum=1),
        max_model_len=table.integer("max_model_len", defaults.max_model_len, minimum=1),
        prefix_caching=table.flag("prefix_caching", defaults.prefix_caching),
        kv_events=table.flag("kv_events", defaults.kv_events),
        extra_args=table.texts("extra_args", defaults.extra_args),
    )


def _check_ports(fleet: FleetFile, path: Path) -> None:
    owners: dict[int, str] = {}
    named = [("[gateway] port", fleet.gateway.port), ("[router] port", fleet.router.port)]
    named += [(f"[[vllm.replica]] #{i + 1} port", r.port) for i, r in enumerate(fleet.replicas)]
    for name, port in named:
        if port and port in owners:
            raise FleetFileError(f"{path}: {name}: {port} is also {owners[port]}")
        owners.setdefault(port, name)


def _model_argument(model: str, folder: Path) -> str:
    """A model name as it is; a path (it has a slash or ends in .gguf) made absolute."""
    if model == DEFAULT_MODEL or ("/" not in model and not model.endswith(".gguf")):
        return model
    return str((folder / Path(model).expanduser()).resolve())


def _served_name(model: str) -> str:
    if "/" not in model:
        return model
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


class _Table:
    """One TOML table being read: typed getters that pop their key, then `finish` refuses
    any key left over (a typo is an error, not a silent default)."""

    def __init__(self, values: dict[str, Any], source: Path, name: str, label: str | None = None):
        self.values = dict(values)
        self.source = source
        self.name = name  # dotted: "", "gateway", "router.policy_params", "vllm.replica"
        self.label = f"[{name}] " if label is None and name else (label or "")

    def error(self, key: str, problem: str) -> FleetFileError:
        return FleetFileError(f"{self.source}: {self.label}{key}: {problem}")

    def _take(self, key: str, kinds: tuple[type, ...], what: str) -> Any:
        value = self.values.pop(key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise self.error(key, f"expected {what}, got {value!r}")
        return value

    def text(self, key: str, default: Any, *, choices: tuple[str, ...] = ()) -> Any:
        value = self._take(key, (str,), "a string")
        if value is None:
            return default
        if choices and value not in choices:
            raise self.error(key, f"{value!r} is not one of {', '.join(choices)}")
        return value

    def url(self, key: str, forms: tuple[str, ...], suffixes: tuple[str, ...] = ()) -> str | None:
        value = self.text(key, None)
        if value is not None and not value.startswith(forms) and not value.endswith(suffixes):
            expected = ", ".join(forms + tuple(f"a path ending in {s}" for s in suffixes))
            raise self.error(key, f"{value!r} is not one of the forms {expected}")
        return value

    def integer(self, key: str, default: int, *, minimum: int) -> int:
        value = self._take(key, (int,), "an integer")
        if value is None:
            return default
        if value < minimum:
            raise self.error(key, f"{value} is below {minimum}")
        return value

    def port(self, key: str, default: int) -> int:
        value = self.integer(key, default, minimum=0)
        if value > 65535:
            raise self.error(key, f"{value} is not a port (0: any free port)")
        return value

    def number(self, key: str) -> float:
        return self._take(key, (int, float), "a number")

    def flag(self, key: str, default: bool) -> bool:
        value = self.values.pop(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def texts(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.values.pop(key, None)
        if value is None:
            return default
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.error(key, f"expected a list of strings, got {value!r}")
        return tuple(value)

    def file(self, key: str) -> Path | None:
        value = self._take(key, (str,), "a path")
        if value is None:
            return None
        path = (self.source.parent / Path(value).expanduser()).resolve()
        if not path.is_file():
            raise self.error(key, f"no such file: {path}")
        return path

    def table(self, key: str) -> _Table:
        value = self.values.pop(key, {})
        name = f"{self.name}.{key}" if self.name else key
        if not isinstance(value, dict):
            raise self.error(key, f"expected a table ([{name}]), got {value!r}")
        return _Table(value, self.source, name)

    def tables(self, key: str) -> list[_Table]:
        value = self.values.pop(key, [])
        name = f"{self.name}.{key}" if self.name else key
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise self.error(key, f"expected an array of tables ([[{name}]]), got {value!r}")
        return [_Table(item, self.source, name, f"[[{name}]] #{i + 1} ")
                for i, item in enumerate(value)]  # fmt: skip

    def finish(self) -> None:
        if self.values:
            unknown = ", ".join(sorted(self.values))
            raise FleetFileError(f"{self.source}: {self.label}unknown key(s): {unknown}")
