import hashlib

import pytest

from once.gateway.admission.auth import KeyRing, Tenant
from once.protocol.errors import AuthenticationError

GOOD_CONFIG = """
[[keys]]
key = "sk-acme-one-0123456789"
tenant = "acme"
requests_per_minute = 60
tokens_per_minute = 100000

[[keys]]
key = "sk-acme-two-0123456789"
tenant = "acme"
requests_per_minute = 60
tokens_per_minute = 100000

[[keys]]
key_sha256 = "{globex_digest}"
tenant = "globex"
""".replace("{globex_digest}", hashlib.sha256(b"sk-globex-secret").hexdigest())


def write(tmp_path, text: str):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return path


@pytest.fixture
def ring(tmp_path) -> KeyRing:
    return KeyRing.from_file(write(tmp_path, GOOD_CONFIG))


def test_keys_map_to_tenants(ring):
    acme = Tenant("acme", requests_per_minute=60, tokens_per_minute=100000)
    assert ring.enabled
    assert ring.authenticate("Bearer sk-acme-one-0123456789") == acme
    assert ring.authenticate("Bearer sk-acme-two-0123456789") == acme
    assert ring.authenticate("bearer  sk-globex-secret ") == Tenant("globex")
    assert [tenant.name for tenant in ring.tenants] == ["acme", "globex"]


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "Missing API key"),
        ("", "Missing API key"),
        ("   ", "Missing API key"),
        ("sk-acme-one-0123456789", "Malformed"),
        ("Basic dXNlcjpwYXNz", "Malformed"),
        ("Bearer", "Malformed"),
        ("Bearer sk-a sk-b", "Malformed"),
        ("Bearer sk-acme-one-012345678", "Incorrect API key provided: sk-...5678"),
        ("Bearer sk-ACME-ONE-0123456789", "Incorrect API key"),
        ("Bearer short", r"Incorrect API key provided: \*\*\*"),
        ("Bearer \udcff-surrogate", "Incorrect API key"),
    ],
)
def test_bad_headers_are_401(ring, header, message):
    with pytest.raises(AuthenticationError, match=message) as info:
        ring.authenticate(header)
    assert info.value.status == 401
    assert info.value.code == "invalid_api_key"


def test_error_never_echoes_a_whole_key(ring):
    with pytest.raises(AuthenticationError) as info:
        ring.authenticate("Bearer sk-almost-acme-one-0123456789")
    assert "sk-almost-acme-one-0123456789" not in info.value.message


def test_open_ring_lets_everyone_in_as_default():
    ring = KeyRing.open()
    assert not ring.enabled
    assert ring.authenticate(None) == Tenant("default")
    assert ring.authenticate("Bearer anything") == Tenant("default")
    assert ring.tenants == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"no API keys"),
        ("keys = []", r"no API keys"),
        ("[[key]]\nkey = 'sk-1'\ntenant = 'a'", r"unknown top-level field"),
        ("[[keys]]\ntenant = 'a'", r"keys\[0\].*exactly one of 'key' or 'key_sha256'"),
        (
            "[[keys]]\nkey = 'sk-1'\nkey_sha256 = '" + "0" * 64 + "'\ntenant = 'a'",
            r"exactly one of",
        ),
        ("[[keys]]\nkey = 'sk-1'", r"keys\[0\]: 'tenant' must be"),
        ("[[keys]]\nkey = 'sk-1'\ntenant = 'a b'", r"'tenant' must be"),
        ("[[keys]]\nkey = 'sk-1'\ntenant = 7", r"'tenant' must be"),
        ("[[keys]]\nkey = 7\ntenant = 'a'", r"'key' must be a non-empty string"),
        ("[[keys]]\nkey = ''\ntenant = 'a'", r"'key' must be a non-empty string"),
        ("[[keys]]\nkey = 'sk 1'\ntenant = 'a'", r"without spaces"),
        ("[[keys]]\nkey_sha256 = 'abc'\ntenant = 'a'", r"64 hex digits"),
        (
            "[[keys]]\nkey = 'sk-1'\ntenant = 'a'\nrequests_per_minute = '60'",
            r"keys\[0\] \(tenant 'a'\).*must be a positive integer",
        ),
        ("[[keys]]\nkey = 'sk-1'\ntenant = 'a'\ntokens_per_minute = 0", r"positive integer"),
        ("[[keys]]\nkey = 'sk-1'\ntenant = 'a'\ntokens_per_minute = true", r"positive integer"),
        ("[[keys]]\nkey = 'sk-1'\ntenant = 'a'\nrequest_per_minute = 5", r"unknown field"),
        (
            "[[keys]]\nkey = 'sk-1'\ntenant = 'a'\n[[keys]]\nkey = 'sk-1'\ntenant = 'b'",
            r"keys\[1\] \(tenant 'b'\): duplicate key, already given in keys\[0\]",
        ),
        (
            "[[keys]]\nkey = 'sk-1'\ntenant = 'a'\n"
            f"[[keys]]\nkey_sha256 = '{hashlib.sha256(b'sk-1').hexdigest()}'\ntenant = 'a'",
            r"duplicate key",
        ),
        (
            "[[keys]]\nkey = 'sk-1'\ntenant = 'a'\nrequests_per_minute = 5\n"
            "[[keys]]\nkey = 'sk-2'\ntenant = 'a'",
            r"keys\[1\].*limits differ from keys\[0\]",
        ),
        ("[[keys]]\nkey = 'sk-1'\ntenant = ", r"not valid TOML"),
        ("keys = ['sk-1']", r"keys\[0\]: expected a table"),
    ],
)
def test_bad_config_is_a_clear_value_error(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as info:
        KeyRing.from_file(path)
    assert str(path) in str(info.value)
    assert "sk-1" not in str(info.value)  # never print a key


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read API key file"):
        KeyRing.from_file(tmp_path / "absent.toml")


def test_keys_are_not_kept_in_plaintext(ring):
    assert "sk-acme-one-0123456789" not in repr(vars(ring))
