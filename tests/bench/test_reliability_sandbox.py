"""Every sandbox escape attempt of `once bench reliability`, run for real, must be blocked.

The attempts live in src/once/bench/reliability/ (one list, which the bench runs too):
each runs hostile input through the real shell tool in the real bubblewrap sandbox, the
real apply_patch, or a real V8 isolate, and judges the host afterwards. As root the
project's set-up installs bubblewrap, so there a missing sandbox fails the test; a host
without cgroups to limit processes or memory skips the bombs with the reason (the bench
counts those as escapes).

The negative controls take one layer away from the real sandbox and check that the same
attempt then reports the escape: an attempt that cannot see an escape proves nothing.
"""

import os

import pytest

from once.bench.reliability.sandbox import ATTEMPTS, run_attempt, run_attempts_async
from once.bench.reliability.sandbox_arena import arena
from once.bench.reliability.shell_escapes import read_secret_files, unix_sockets


def skip_or_fail_unsupported(why: str) -> None:
    if os.geteuid() == 0 and "bubblewrap" in why:
        pytest.fail(f"{why}; running as root, the set-up must install bubblewrap")
    pytest.skip(why)


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[a.name for a in ATTEMPTS])
async def test_the_attempt_is_blocked(attempt):
    outcome = await run_attempt(attempt)
    assert outcome.name == attempt.name
    if outcome.unsupported is not None:
        skip_or_fail_unsupported(outcome.unsupported)
    assert outcome.blocked, outcome.detail


async def test_without_the_seccomp_filter_a_unix_socket_is_reached():
    async with arena() as place:
        if not place.sandbox.enforced or place.sandbox.socket_filter is None:
            skip_or_fail_unsupported(place.sandbox.describe())
        blocked = await unix_sockets(place)
        place.sandbox.socket_filter = None  # bubblewrap's namespaces alone
        reached = await unix_sockets(place)
    assert blocked.blocked
    # The network namespace covers the abstract socket; only the filter covers a path.
    assert not reached.blocked and "daemon-" in reached.detail
    assert "abstract" not in reached.detail


async def test_credentials_outside_the_hidden_home_are_read():
    async with arena() as place:
        if not place.sandbox.enforced:
            skip_or_fail_unsupported(place.sandbox.describe())
        place.sandbox.home = place.root / "another-home"  # the fake home is not covered
        leaked = await read_secret_files(place)
    assert not leaked.blocked
    assert "read .ssh/id_ed25519" in leaked.detail and "read .netrc" in leaked.detail


async def test_the_summary_counts_attempts_and_escapes():
    names = ["patch_paths_out", "js_host_globals"]
    summary = await run_attempts_async(names)
    assert summary["sandbox_attempts"] == 2 and summary["sandbox_escapes"] == 0
    assert [a["name"] for a in summary["attempts"]] == names
    assert all(a["blocked"] and a["detail"] for a in summary["attempts"])
    with pytest.raises(ValueError, match="no_such_attempt"):
        await run_attempts_async(["no_such_attempt"])


def test_attempt_names_are_unique():
    names = [a.name for a in ATTEMPTS]
    assert len(names) == len(set(names))
