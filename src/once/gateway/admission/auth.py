"""API keys per tenant, loaded from a TOML file.

    [[keys]]
    key = "sk-..."                 # or key_sha256 = "<64 hex digits>" to keep no plaintext
    tenant = "acme"
    requests_per_minute = 60       # optional; absent means unlimited
    tokens_per_minute = 100000     # optional

Several keys may map to one tenant; limits belong to the tenant (the rate limiter counts
per tenant), so every key of a tenant must state the same limits.

Keys are kept only as SHA-256 digests and looked up by digest. Timing of the lookup can
reveal at most something about the digest of the guess, which does not help forge a key:
this is the constant-time comparison without a loop over all keys.
"""

import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from once.protocol.errors import AuthenticationError

# Tenant names end up in store keys, cache salts and metric labels: keep them plain.
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_ENTRY_FIELDS = {"key", "key_sha256", "tenant", "requests_per_minute", "tokens_per_minute"}
_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute")


@dataclass(frozen=True)
class Tenant:
    name: str
    requests_per_minute: int | None = None  # None: unlimited
    tokens_per_minute: int | None = None


DEFAULT_TENANT = Tenant("default")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "replace")).digest()


def _mask(key: str) -> str:
    # Enough of a wrong key to recognise it in a message, never enough to matter.
    return f"{key[:3]}...{key[-4:]}" if len(key) >= 12 else "***"


class KeyRing:
    def __init__(self, tenants_by_digest: dict[bytes, Tenant] | None):
        # None: an open ring (auth disabled); otherwise digest of key -> tenant.
        self._tenants_by_digest = tenants_by_digest

    @classmethod
    def open(cls) -> "KeyRing":
        return cls(None)

    @classmethod
    def from_file(cls, path: str | Path) -> "KeyRing":
        path = Path(path)
        try:
            config = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"cannot read API key file {path}: {exc.strerror}") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"API key file {path} is not valid TOML: {exc}") from exc
        return cls(_parse_keys(config, str(path)))

    @property
    def enabled(self) -> bool:
        return self._tenants_by_digest is not None

    @property
    def tenants(self) -> list[Tenant]:
        unique = {} if self._tenants_by_digest is None else self._tenants_by_digest.values()
        return sorted(set(unique), key=lambda tenant: tenant.name)

    def authenticate(self, authorization: str | None) -> Tenant:
        """`authorization` is the Authorization header's value, "Bearer sk-..."."""
        if self._tenants_by_digest is None:
            return DEFAULT_TENANT
        if authorization is None or not authorization.strip():
            raise AuthenticationError(
                "Missing API key: send it in the Authorization header as 'Bearer <key>'."
            )
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key or " " in key:
            raise AuthenticationError("Malformed Authorization header: expected 'Bearer <key>'.")
        tenant = self._tenants_by_digest.get(_digest(key))
        if tenant is None:
            raise AuthenticationError(f"Incorrect API key provided: {_mask(key)}.")
        return tenant


def _parse_keys(config: dict, source: str) -> dict[bytes, Tenant]:
    entries = config.get("keys")
    unknown = set(config) - {"keys"}
    if unknown:
        raise ValueError(
            f"{source}: unknown top-level field(s) {sorted(unknown)}; expected [[keys]]"
        )
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source}: no API keys; expected one or more [[keys]] tables")

    tenants_by_digest: dict[bytes, Tenant] = {}
    entry_by_digest: dict[bytes, int] = {}
    tenants_by_name: dict[str, tuple[Tenant, int]] = {}
    for index, entry in enumerate(entries):
        where = f"{source}: keys[{index}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a table with key and tenant")
        tenant = _parse_tenant(entry, where)
        where = f"{where} (tenant {tenant.name!r})"
        digest = _parse_digest(entry, where)
        if digest in entry_by_digest:
            raise ValueError(
                f"{where}: duplicate key, already given in keys[{entry_by_digest[digest]}]"
            )
        earlier = tenants_by_name.get(tenant.name)
        if earlier is not None and earlier[0] != tenant:
            raise ValueError(
                f"{where}: limits differ from keys[{earlier[1]}] of the same tenant; "
                "limits belong to the tenant, so give every key of it the same limits"
            )
        tenants_by_name.setdefault(tenant.name, (tenant, index))
        entry_by_digest[digest] = index
        tenants_by_digest[digest] = tenant
    return tenants_by_digest


def _parse_tenant(entry: dict, where: str) -> Tenant:
    unknown = set(entry) - _ENTRY_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    name = entry.get("tenant")
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise ValueError(
            f"{where}: 'tenant' must be a name of letters, digits, '.', '_' or '-' "
            f"(at most 64, starting with a letter or digit), got {name!r}"
        )
    where = f"{where} (tenant {name!r})"
    limits = {}
    for field in _LIMIT_FIELDS:
        value = entry.get(field)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{where}: {field!r} must be a positive integer, got {value!r}")
        limits[field] = value
    return Tenant(name, **limits)


def _parse_digest(entry: dict, where: str) -> bytes:
    key, key_sha256 = entry.get("key"), entry.get("key_sha256")
    if (key is None) == (key_sha256 is None):
        raise ValueError(f"{where}: give exactly one of 'key' or 'key_sha256'")
    if key is not None:
        if not isinstance(key, str) or not key or any(char.isspace() for char in key):
            raise ValueError(f"{where}: 'key' must be a non-empty string without spaces")
        return _digest(key)
    if not isinstance(key_sha256, str) or not _SHA256_HEX.fullmatch(key_sha256):
        raise ValueError(f"{where}: 'key_sha256' must be 64 hex digits (sha256 of the key)")
    return bytes.fromhex(key_sha256)
