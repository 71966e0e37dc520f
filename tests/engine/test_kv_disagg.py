"""Prefill/decode roles: a prefill engine's KV reaches a decode engine through shm or TCP,
and the decode side's tokens and logits are those of a colocated run."""

import pytest
import torch

from once.engine.config import EngineConfig
from once.engine.core import LLMEngine
from once.engine.kv.block_codec import encode_block
from once.engine.kv.disagg.peers import PeerSet, open_peer
from once.engine.kv.disagg.transfer import TransferStore
from once.protocol.engine import GenerateRequest, SamplingParams
from once.protocol.errors import InvalidRequestError
from tests.engine.test_engine_parity import assert_logits_match, capture_logits, prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = prompts(7, [39])[0]  # 9 full blocks of 4, a tail of 2 and the last token


def engine(model_dir, **settings) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=32, **settings)
    return LLMEngine(config)


def run(engine: LLMEngine, request_id: str, tokens, **request_fields):
    request = GenerateRequest(request_id, tuple(tokens), GREEDY, **request_fields)
    return engine.generate([request])[request_id]


def output_ids(deltas) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_decode_engine_continues_from_the_prefill_engines_kv(
    tiny_model_dir, tiny_reference, transport
):
    colocated = output_ids(run(engine(tiny_model_dir), "c", PROMPT))
    prefill = engine(tiny_model_dir, role="prefill", kv_transfer=transport)
    deltas = run(prefill, "p", PROMPT, kv_transfer_params={"do_remote_decode": True})
    assert output_ids(deltas) == colocated[:1]  # one token at most
    params = deltas[-1].kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_num_blocks"] == 9
    aligned = PROMPT[:36]  # 9 full blocks: the ninth is the tail (its last token computed)
    out = run(engine(tiny_model_dir, role="decode"), "a", aligned, kv_transfer_params=run(
        prefill, "pa", aligned)[-1].kv_transfer_params)  # fmt: skip
    assert out[-1].metrics.num_computed_tokens == 1
    assert params["remote_address"].startswith("tcp://" if transport == "tcp" else "shm:")

    decode = engine(tiny_model_dir, role="decode")
    records = capture_logits(decode)
    out = run(decode, "d", PROMPT, kv_transfer_params=params)
    assert output_ids(out) == colocated
    metrics = out[-1].metrics
    assert metrics.num_cached_tokens == 38  # nine full blocks and the tail came over
    assert metrics.num_computed_tokens == 1  # the last prompt token
    stats = decode.stats()
    assert stats["kv_tier_transfer_hit_blocks"] == 9
    assert stats["kv_tier_transfer_loaded_bytes"] > 0
    assert_logits_match(tiny_reference, records)
    for each in (prefill, decode):
        each.close()


def test_blocks_the_decode_engine_holds_are_not_fetched(tiny_model_dir):
    prefill = engine(tiny_model_dir, role="prefill")
    decode = engine(tiny_model_dir, role="decode")
    run(decode, "earlier", PROMPT[:20])  # five of the prompt's blocks are cached here
    params = run(prefill, "p", PROMPT)[-1].kv_transfer_params
    out = run(decode, "d", PROMPT, kv_transfer_params=params)
    assert out[-1].metrics.num_cached_tokens == 38
    assert decode.stats()["kv_tier_transfer_hit_blocks"] == 4
    for each in (prefill, decode):
        each.close()


def test_a_prefill_cache_hit_still_reaches_the_store(tiny_model_dir):
    prefill = engine(tiny_model_dir, role="prefill", kv_transfer_blocks=10)
    run(prefill, "first", PROMPT)
    run(prefill, "other", prompts(8, [39])[0])  # its blocks push PROMPT's out of the store
    params = run(prefill, "again", PROMPT)[-1].kv_transfer_params  # all from the prefix cache
    assert prefill.stats()["num_cached_prompt_tokens"] == 36
    decode = engine(tiny_model_dir, role="decode")
    assert run(decode, "d", PROMPT, kv_transfer_params=params)[-1].metrics.num_cached_tokens == 38
    for each in (prefill, decode):
        each.close()


def test_a_gone_prefill_engine_means_recompute_not_failure(tiny_model_dir):
    colocated = output_ids(run(engine(tiny_model_dir), "c", PROMPT))
    prefill = engine(tiny_model_dir, role="prefill", kv_transfer="tcp")
    params = run(prefill, "p", PROMPT)[-1].kv_transfer_params
    prefill.close()  # the port is closed and the store gone
    decode = engine(tiny_model_dir, role="decode")
    out = run(decode, "d", PROMPT, kv_transfer_params=params)
    assert output_ids(out) == colocated and out[-1].metrics.num_cached_tokens == 0
    decode.close()


def test_a_bad_remote_address_is_a_400_naming_the_param(tiny_model_dir):
    decode = engine(tiny_model_dir, role="decode")
    for params in ({"do_remote_prefill": True}, {"do_remote_prefill": True,
                                                  "remote_address": "ftp://x"}):  # fmt: skip
        with pytest.raises(InvalidRequestError) as caught:
            decode.add_request(GenerateRequest("d", tuple(PROMPT), GREEDY,
                                               kv_transfer_params=params))  # fmt: skip
        assert caught.value.param == "kv_transfer_params.remote_address"
    decode.close()


def test_a_torn_or_corrupt_block_in_the_store_is_a_miss(tmp_path):
    store = TransferStore(8, root=str(tmp_path))
    k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8)
    fingerprint = b"f" * 16
    store.put(5, encode_block(fingerprint, 5, k, v))
    peer = open_peer(store.address)
    data = peer.get(5)
    assert data is not None and bytes(data[:8]) == b"ONCEKV01"
    peers = PeerSet()
    peers.add(store.address)
    assert peers.get(6) is None  # never written
    (store.folder / f"{5:016x}").write_bytes(b"short")
    from once.engine.kv.block_codec import decode_block

    assert not decode_block(peers.get(5), fingerprint, 5, torch.empty_like(k), torch.empty_like(v))
    store.close()
    assert not store.folder.exists()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_prefill_engine_holds_blocks_until_the_decode_side_releases_them(
    tiny_model_dir, transport
):
    # A store of 10 blocks: the next prompt's ten would push PROMPT's out, were they not
    # held for the decode side.
    prefill = engine(tiny_model_dir, role="prefill", kv_transfer=transport, kv_transfer_blocks=10)
    leg = {"do_remote_decode": True}  # what a router's prefill leg says
    params = run(prefill, "p", PROMPT, kv_transfer_params=leg)[-1].kv_transfer_params
    assert params["remote_request_id"] == "p"
    # A request with no decode side announced: its blocks are stored, not held.
    other = run(prefill, "other", prompts(8, [39])[0])[-1].kv_transfer_params
    assert "remote_request_id" not in other
    stats = prefill.stats()
    assert stats["kv_transfer_holds"] == 1 and stats["kv_transfer_held_blocks"] == 10
    assert stats["kv_transfer_blocks"] == 20  # ten held, ten within the bound
    decode = engine(tiny_model_dir, role="decode")
    assert run(decode, "d", PROMPT, kv_transfer_params=params)[-1].metrics.num_cached_tokens == 38
    decode.connector.flush(loads=True)  # the release went out on the loader thread
    store = prefill.connector.transfer
    store.collect_releases()  # what the next write does
    assert (store.num_holds, store.num_released) == (0, 1)
    for each in (prefill, decode):
        each.close()


def test_a_hold_nobody_releases_ends_after_hold_s_or_when_holds_fill_the_store(tmp_path):
    clock = [1000.0]
    store = TransferStore(2, root=str(tmp_path), hold_s=60.0, clock=lambda: clock[0])
    for block_hash in (1, 2):
        store.put(block_hash, b"x")
    store.hold("r", [1, 2, 3])  # 3 was never stored: nothing to hold
    assert store.num_held_blocks == 2
    store.put(4, b"x")  # over capacity, but 1 and 2 are held
    assert 1 in store and 2 in store and len(store) == 3
    clock[0] += 61
    store.put(5, b"x")
    assert store.num_expired == 1 and len(store) == 2 and 1 not in store
    store.hold("s", [4])
    store.hold("t", [5])
    store.put(6, b"x")
    store.hold("u", [6])  # three held blocks, two of room: the oldest hold ends
    assert (store.num_holds, store.num_held_blocks, store.num_expired) == (2, 2, 2)
    store.close()
