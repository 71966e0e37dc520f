"""What an engine's disaggregation role changes about a request, on its way in and out.

- prefill: a request decodes one token at most (the decode engine makes the rest). When it
  finishes, every full block of its prompt is in the transfer store: those it computed went
  there as they filled; those its own prefix cache supplied are written now. When the
  request said `do_remote_decode` (a router's prefill leg), the store holds them for the
  decode side (TransferStore.hold). Its last delta then says where they
  are (`kv_transfer_params`, vLLM's field, with `remote_request_id` naming the hold), and
  is sent only once the writes are done, so the decode engine never asks for a block still
  in flight.
- decode: a request whose `kv_transfer_params` say `do_remote_prefill` names its prefill
  engine's store; the engine adds it to its peers, and admission finds the prompt's blocks
  there like any lower tier (one token is left to compute: the first output token's). Once
  the request is admitted (its blocks loaded, or given up on), the engine releases the
  hold (TieredConnector.release_transfer).
- both: the params are ignored, as a colocated vLLM ignores them.
"""

from dataclasses import replace

from once.engine.kv.disagg.peers import PeerSet
from once.engine.kv.disagg.transfer import TransferStore
from once.engine.kv.tiered_connector import TieredConnector
from once.protocol.engine import GenerateRequest
from once.protocol.errors import InvalidRequestError

ADDRESS_PARAM = "kv_transfer_params.remote_address"


def admit_for_role(
    request: GenerateRequest, role: str, connector: TieredConnector | None
) -> GenerateRequest:
    if role == "prefill":
        sampling, forced = request.sampling, request.forced_output_ids
        if sampling.max_tokens > 1 or (forced is not None and len(forced) > 1):
            request = replace(
                request,
                sampling=replace(sampling, max_tokens=1),
                forced_output_ids=None if forced is None else forced[:1],
            )
        return request
    params = request.kv_transfer_params
    if role != "decode" or not params or not params.get("do_remote_prefill"):
        return request
    address = params.get("remote_address")
    if not isinstance(address, str) or not address:
        raise InvalidRequestError(
            "kv_transfer_params.do_remote_prefill needs remote_address, the prefill "
            "engine's store (its last delta's kv_transfer_params)",
            param=ADDRESS_PARAM,
        )
    assert connector is not None and isinstance(connector.transfer, PeerSet)  # role decode
    try:
        connector.transfer.add(address)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param=ADDRESS_PARAM) from exc
    return request


def transfer_source(request: GenerateRequest) -> tuple[str, str] | None:
    """(prefill store address, request id there) of a request prefilled remotely."""
    params = request.kv_transfer_params or {}
    address, remote_id = params.get("remote_address"), params.get("remote_request_id")
    if params.get("do_remote_prefill") and isinstance(address, str) and isinstance(remote_id, str):
        return address, remote_id
    return None


def finish_prefill(
    request_id: str,
    prompt_hashes: list[int],
    tail_hash: int | None,
    connector: TieredConnector,
    read_block,
    block_size: int,
    hold: bool = True,
) -> dict:
    """Make sure the store has every full prompt block and, with `hold` (the request said
    `do_remote_decode`), hold them and the prompt's tail for the decode side; the params
    that tell it where they are."""
    store = connector.transfer
    assert isinstance(store, TransferStore)  # role prefill
    connector.flush()  # the blocks saved as they filled are written
    missing = [h for h in prompt_hashes if h not in store]
    for block_hash in missing:
        blocks = read_block(block_hash)  # a prefix-cache hit: K/V from the device pool
        if blocks is not None:
            connector.save(block_hash, *blocks)
    if missing:
        connector.flush()
    params = {
        "do_remote_prefill": True,
        "remote_address": store.address,
        "remote_num_blocks": len(prompt_hashes),
        "remote_block_size": block_size,
    }
    if hold:
        store.hold(request_id, [*prompt_hashes, *([] if tail_hash is None else [tail_hash])])
        params["remote_request_id"] = request_id  # the decode side releases by it
    return params
