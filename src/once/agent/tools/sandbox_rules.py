"""What the sandbox hides and forbids beyond its read-only view: credentials, Unix sockets.

Credentials. The sandbox lets a command read the whole file system (compilers, the
language runtimes under the home directory, the repository's siblings), so the places
where credentials conventionally live are covered, each by an empty tmpfs (a directory)
or /dev/null (a file): SSH and GPG keys, cloud and cluster credentials, package-registry
tokens, the coding agents' own logins, browser profiles, and /etc/shadow. A command that
needs one of them is a command to run outside the sandbox, with the user's approval.

Unix sockets. A socket file is reachable through a read-only mount (connect() needs no
write access to the file system, only to the socket's inode), so the network namespace
does not cover a daemon listening on a path: Docker's socket would be root on the host.
A seccomp filter makes socket(AF_UNIX, ...) fail with EACCES inside the sandbox; a pair
of connected sockets from socketpair() still works (asyncio and many test runners use
it). It costs what needs a named Unix socket inside the sandbox too (a multiprocessing
Manager, a forkserver), which fails as "permission denied" and so is offered the
unsandboxed retry. The filter is compiled by libseccomp (through pyseccomp); 32-bit
system calls, which could reach socket() through socketcall(), are killed.
"""

import errno
import functools
import glob
import os
import socket
import tempfile
from pathlib import Path

# Relative to the home directory: a directory is emptied, a file reads as empty.
SECRET_HOME_PATHS = (
    ".ssh",
    ".gnupg",
    ".password-store",
    ".local/share/keyrings",
    ".aws",
    ".azure",
    ".config/gcloud",
    ".oci",
    ".kube",
    ".docker",
    ".netrc",
    ".git-credentials",
    ".config/gh",
    ".config/hub",
    ".npmrc",
    ".yarnrc.yml",
    ".pypirc",
    ".cargo/credentials",
    ".cargo/credentials.toml",
    ".gem/credentials",
    ".terraform.d/credentials.tfrc.json",
    ".vault-token",
    ".cache/huggingface/token",
    ".cache/huggingface/stored_tokens",
    ".huggingface/token",
    ".codex",
    ".claude",
    ".claude.json",
    ".config/op",
    ".mozilla",
    ".config/google-chrome",
    ".config/chromium",
)
SECRET_SYSTEM_PATHS = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-")
SECRET_SYSTEM_GLOBS = ("/etc/ssh/ssh_host_*_key",)  # host private keys (not the .pub)


def secret_paths(home: Path) -> list[Path]:
    """The credential paths that exist here, resolved (a symlink's target is what's read)."""
    candidates = [home / relative for relative in SECRET_HOME_PATHS]
    candidates += [Path(p) for p in SECRET_SYSTEM_PATHS]
    candidates += [Path(p) for pattern in SECRET_SYSTEM_GLOBS for p in sorted(glob.glob(pattern))]
    found: dict[Path, None] = {}
    for path in candidates:
        if os.path.lexists(path):
            found[path.resolve()] = None
    return list(found)


def hiding_flags(paths: list[Path]) -> list[str]:
    """bubblewrap mounts over each path: an empty tmpfs for a directory, /dev/null else."""
    flags: list[str] = []
    for path in paths:
        if path.is_dir():
            flags += ["--tmpfs", str(path)]
        elif path.exists():
            flags += ["--ro-bind", "/dev/null", str(path)]
    return flags


@functools.cache
def unix_socket_filter() -> tuple[bytes | None, str]:
    """(the compiled seccomp program, "") or (None, why it cannot be built here)."""
    try:
        import pyseccomp as seccomp  # loads libseccomp with ctypes at import
    except (ImportError, RuntimeError, OSError) as e:
        return None, f"no seccomp filter for Unix sockets (pyseccomp/libseccomp: {e})"
    program = seccomp.SyscallFilter(seccomp.ALLOW)
    program.add_rule(
        seccomp.ERRNO(errno.EACCES), "socket", seccomp.Arg(0, seccomp.EQ, socket.AF_UNIX)
    )
    try:
        with tempfile.TemporaryFile() as compiled:
            program.export_bpf(compiled)
            compiled.seek(0)
            return compiled.read(), ""
    except OSError as e:
        return None, f"no seccomp filter for Unix sockets (export failed: {e})"


def filter_fd(program: bytes) -> int:
    """A file descriptor holding `program`, at its start, for bwrap's `--seccomp FD`."""
    fd = os.memfd_create("once-seccomp", 0)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
