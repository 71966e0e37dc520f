"""Fleet files: the example as shipped, the defaults, and one line naming the key for each
kind of mistake (never a traceback); `once fleet check` prints the plan or that line."""

import os
from pathlib import Path

import pytest

from once.fleet.cli import main as fleet_main
from once.fleet.fleet_file import FleetFileError, load_fleet_file, parse_fleet
from once.model_files import DEFAULT_MODEL

EXAMPLE = Path(__file__).parents[2] / "examples" / "vllm-fleet.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(FleetFileError) as caught:
        load_fleet_file(write(tmp_path, text))
    return str(caught.value)


def test_the_example_reads_as_its_comments_say():
    fleet = load_fleet_file(EXAMPLE)
    assert fleet.model == fleet.served_model_name == DEFAULT_MODEL
    assert (fleet.gateway.host, fleet.gateway.port, fleet.gateway.safety) == (
        "127.0.0.1",
        8000,
        "stream",
    )
    assert (fleet.router.port, fleet.router.policy) == (0, "once")
    assert len(fleet.replicas) == 2
    shared = max(1, len(os.sched_getaffinity(0)) // 2)
    for replica in fleet.replicas:
        assert (replica.port, replica.kv_cache_mib, replica.threads) == (0, 512, shared)
        assert (replica.block_size, replica.max_model_len) == (32, 4096)
        assert replica.prefix_caching and replica.kv_events and replica.extra_args == ()


def test_an_empty_file_is_one_replica_of_the_default_model(tmp_path):
    fleet = load_fleet_file(write(tmp_path, ""))
    assert fleet.model == DEFAULT_MODEL and len(fleet.replicas) == 1
    assert fleet.gateway.store is None and fleet.gateway.api_keys is None


def test_replica_tables_override_the_shared_settings(tmp_path):
    (tmp_path / "keys.toml").write_text("")
    fleet = load_fleet_file(write(tmp_path, """
        model = "models/my-llama"
        [gateway]
        store = "redis://10.0.0.5:6379/0"
        api_keys = "keys.toml"
        [router.policy_params]
        prefix_affinity_margin = 0.5
        [vllm]
        kv_cache_mib = 256
        threads = 1
        max_model_len = 8192
        [[vllm.replica]]
        port = 8101
        [[vllm.replica]]
        port = 8102
        max_model_len = 2048
        kv_events = false
        extra_args = ["--seed", "1"]
    """))  # fmt: skip
    assert fleet.model == str(tmp_path / "models" / "my-llama")  # relative to the file
    assert fleet.served_model_name == "my-llama"
    assert fleet.gateway.api_keys == tmp_path / "keys.toml"
    assert fleet.router.policy_params == {"prefix_affinity_margin": 0.5}
    first, second = fleet.replicas
    assert (first.port, first.kv_cache_mib, first.max_model_len, first.kv_events) == (
        8101,
        256,
        8192,
        True,
    )
    assert (second.port, second.threads, second.kv_events) == (8102, 1, False)
    assert second.extra_args == ("--seed", "1")
    assert fleet.max_model_len == 2048  # the gateway's: every replica holds a request


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("modle = 'x'", "fleet.toml: unknown key(s): modle"),
        ("[gateway]\nprot = 1", "[gateway] unknown key(s): prot"),
        ("[vllm]\nkv_cache_mib = '512'", "[vllm] kv_cache_mib: expected an integer, got '512'"),
        ("[vllm]\nthreads = true", "[vllm] threads: expected an integer, got True"),
        ("[vllm]\nkv_cache_mib = 0", "[vllm] kv_cache_mib: 0 is below 1"),
        ("[vllm]\nkv_events = 1", "[vllm] kv_events: expected true or false, got 1"),
        ("[vllm]\nextra_args = '--x'", "[vllm] extra_args: expected a list of strings"),
        ("[gateway]\nport = 70000", "[gateway] port: 70000 is not a port"),
        ("[router]\npolicy = 'fastest'", "[router] policy: 'fastest' is not one of cache_aware"),
        ("[router.policy_params]\nnope = 1", "[router] policy_params: bad parameters for policy"),
        (
            "[router.policy_params]\nmargin = 'x'",
            "[router.policy_params] margin: expected a number",
        ),
        (
            "[gateway]\nsafety = 'strict'",
            "[gateway] safety: 'strict' is not one of stream, hold, off",
        ),
        ("[gateway]\nstore = 'postgres://db'", "[gateway] store: 'postgres://db' is not one of"),
        ("[gateway]\nrate_limit_storage = 'x.db'", "[gateway] rate_limit_storage: 'x.db'"),
        ("[gateway]\napi_keys = 'keys.toml'", "[gateway] api_keys: no such file: "),
        ("gateway = 3", "gateway: expected a table ([gateway]), got 3"),
        ("[vllm]\nreplica = 3", "[vllm] replica: expected an array of tables ([[vllm.replica]])"),
        ("[[vllm.replica]]\n[[vllm.replica]]\nthreads = 'x'", "[[vllm.replica]] #2 threads"),
        ("[[vllm.replica]]\nport = 1\nkv = 2", "[[vllm.replica]] #1 unknown key(s): kv"),
        ("[vllm]\ncount = 3\n[[vllm.replica]]", "[vllm] count: 3 does not match the 1"),
        ("[vllm]\ncount = 2\nport = 8101", "[vllm] port: give each replica its own port"),
        ("[router]\nport = 8000", "[router] port: 8000 is also [gateway] port"),
        ("[[vllm.replica]]\nblock_size = 16\n[[vllm.replica]]", "block_size: replicas differ"),
        ("model = ", "not valid TOML"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_key(tmp_path, text, message):
    assert message in error_of(tmp_path, text)


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(FleetFileError, match="cannot read fleet file .*absent.toml"):
        load_fleet_file(tmp_path / "absent.toml")


def test_a_gguf_model_is_served_by_its_stem(tmp_path):
    fleet = parse_fleet({"model": "/models/Tiny.Q4.gguf"}, tmp_path / "fleet.toml")
    assert (fleet.model, fleet.served_model_name) == ("/models/Tiny.Q4.gguf", "Tiny.Q4")


def test_check_prints_the_plan_and_a_bad_file_exits_2_without_a_traceback(tmp_path, capsys):
    assert fleet_main(["check", str(EXAMPLE)]) == 0
    plan = capsys.readouterr().out
    for name in ("model", "vllm-0", "vllm-1", "router", "gateway", "vLLM"):
        assert f"\n{name} " in "\n" + plan
    assert "policy once" in plan and "port 8000" in plan

    assert fleet_main(["check", str(write(tmp_path, "[vllm]\nthreads = -1"))]) == 2
    captured = capsys.readouterr()
    assert (
        captured.err.strip()
        == f"once fleet: {tmp_path / 'fleet.toml'}: [vllm] threads: -1 is below 0"
    )
    assert "Traceback" not in captured.err
