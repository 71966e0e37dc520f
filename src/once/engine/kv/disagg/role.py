"""The prefill and decode roles as connectors: tiers plus a transfer store, or its peers.
What a role changes about a request, on its way in and out:

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
  hold (DecodeConnector.release_transfer).
- both: the params are ignored, as a colocated vLLM ignores them (TieredConnector, or
  no connector at all).
"""

from collections.abc import Sequence
from dataclasses import replace

from once.engine.kv.block_codec import decode_block
from once.engine.kv.connector import ScheduledItem
from once.engine.kv.disagg.peers import PeerSet
from once.engine.kv.disagg.transfer import TransferStore
from once.engine.kv.tiered_connector import TieredConnector
from once.engine.request import Request
from once.protocol.engine import FINISH_LENGTH, FINISH_STOP, GenerateRequest
from once.protocol.errors import InvalidRequestError

ADDRESS_PARAM = "kv_transfer_params.remote_address"


class PrefillConnector(TieredConnector):
    """The tiers, with a transfer store among them (written as blocks fill)."""

    role = "prefill"
    transfer: TransferStore

    def on_arrival(self, request: GenerateRequest) -> GenerateRequest:
        sampling, forced = request.sampling, request.forced_output_ids
        if sampling.max_tokens > 1 or (forced is not None and len(forced) > 1):
            request = replace(
                request,
                sampling=replace(sampling, max_tokens=1),
                forced_output_ids=None if forced is None else forced[:1],
            )
        return request

    def on_admit(self, request: Request, kv_transfer_params: dict | None) -> None:
        request.kv_hold_for_decode = bool((kv_transfer_params or {}).get("do_remote_decode"))

    def after_forward(self, scheduled: Sequence[ScheduledItem]) -> None:
        super().after_forward(scheduled)
        # A prompt finishing its prefill this step: its partial last block goes to the
        # transfer store beside the full ones, for the decode side only (not a cache block).
        for request, tail_hash, k, v in self._io().prompt_tails(scheduled):
            self._write_below(self.transfer, tail_hash, k.clone(), v.clone())
            request.kv_prompt_tail_hash = tail_hash

    def on_finish(self, request: Request) -> dict | None:
        if request.finish_reason not in (FINISH_STOP, FINISH_LENGTH):
            return None
        num_blocks = request.num_prompt_tokens // self.block_size
        return self.finish_prefill(
            request.request_id,
            request.block_hashes[:num_blocks],
            request.kv_prompt_tail_hash,
            hold=request.kv_hold_for_decode,
        )

    def finish_prefill(
        self,
        request_id: str,
        prompt_hashes: list[int],
        tail_hash: int | None,
        hold: bool = True,
    ) -> dict:
        """Make sure the store has every full prompt block and, with `hold` (the request
        said `do_remote_decode`), hold them and the prompt's tail for the decode side; the
        params that tell it where they are."""
        store = self.transfer
        self.flush()  # the blocks saved as they filled are written
        missing = [h for h in prompt_hashes if h not in store]
        for block_hash in missing:
            blocks = self._io().read_block(block_hash)  # a prefix-cache hit: from the device
            if blocks is not None:
                self.save(block_hash, *blocks)
        if missing:
            self.flush()
        params = {
            "do_remote_prefill": True,
            "remote_address": store.address,
            "remote_num_blocks": len(prompt_hashes),
            "remote_block_size": self.block_size,
        }
        if hold:
            store.hold(request_id, [*prompt_hashes, *([] if tail_hash is None else [tail_hash])])
            params["remote_request_id"] = request_id  # the decode side releases by it
        return params

    def stats(self) -> dict:
        store = self.transfer
        return {
            "kv_transfer_address": store.address,
            "kv_transfer_blocks": len(store),
            "kv_transfer_held_blocks": store.num_held_blocks,
            "kv_transfer_holds": store.num_holds,
            "kv_transfer_released": store.num_released,
            "kv_transfer_expired": store.num_expired,
            **super().stats(),
        }


class DecodeConnector(TieredConnector):
    """The tiers, with the prefill engines' stores as the lowest (read only)."""

    role = "decode"
    transfer: PeerSet
    writes_transfer = False

    def on_arrival(self, request: GenerateRequest) -> GenerateRequest:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return request
        address = params.get("remote_address")
        if not isinstance(address, str) or not address:
            raise InvalidRequestError(
                "kv_transfer_params.do_remote_prefill needs remote_address, the prefill "
                "engine's store (its last delta's kv_transfer_params)",
                param=ADDRESS_PARAM,
            )
        try:
            self.transfer.add(address)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param=ADDRESS_PARAM) from exc
        return request

    def on_admit(self, request: Request, kv_transfer_params: dict | None) -> None:
        request.kv_remote_tail = bool((kv_transfer_params or {}).get("do_remote_prefill"))
        if request.kv_remote_tail:
            request.kv_transfer_source = transfer_source(kv_transfer_params)

    def load_tail(self, block_id: int, tail_hash: int) -> bool:
        k, v = self._io().slot(block_id)
        return decode_block(self.transfer.get(tail_hash), self.fingerprint, tail_hash, k, v)

    def after_forward(self, scheduled: Sequence[ScheduledItem]) -> None:
        super().after_forward(scheduled)
        for item in scheduled:
            self.release_transfer(item.request)  # admitted: its loads are over

    def on_finish(self, request: Request) -> dict | None:
        self.release_transfer(request)  # aborted or failed before its admission
        return None

    def release_transfer(self, request: Request) -> None:
        """The request is done with its prefill engine's blocks: tell that engine, on the
        loader thread (after the loads queued before, off the step loop)."""
        source = request.kv_transfer_source
        if source is not None:
            request.kv_transfer_source = None
            self._loader.submit(self.transfer.release, *source)


def transfer_source(kv_transfer_params: dict | None) -> tuple[str, str] | None:
    """(prefill store address, request id there) of a request prefilled remotely."""
    params = kv_transfer_params or {}
    address, remote_id = params.get("remote_address"), params.get("remote_request_id")
    if params.get("do_remote_prefill") and isinstance(address, str) and isinstance(remote_id, str):
        return address, remote_id
    return None
