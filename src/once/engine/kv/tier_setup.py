"""Build an engine's connector from its config: the one place that knows every tier and
role (tiers: TieredConnector; a prefill or decode role: PrefillConnector or
DecodeConnector, the tiers with a transfer store or its peers)."""

from pathlib import Path

import torch

from once.engine.config import EngineConfig
from once.engine.kv.block_codec import layout_fingerprint
from once.engine.kv.disagg.peers import PeerSet
from once.engine.kv.disagg.role import DecodeConnector, PrefillConnector
from once.engine.kv.disagg.transfer import TransferStore
from once.engine.kv.disk_tier import DiskTier
from once.engine.kv.host_tier import HostTier
from once.engine.kv.tiered_connector import TieredConnector
from once.kv_eviction.policies import eviction_factory


def model_identity(model_path: Path) -> str:
    """The model's files by name and size: a different model, or the same one converted
    anew with other weights, gets another layout fingerprint."""
    path = Path(model_path)
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return str(path.resolve()) + "".join(
        f"|{f.name}:{f.stat().st_size}" for f in files if f.is_file()
    )


def build_connector(
    config: EngineConfig,
    model_path: Path,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    num_device_blocks: int,
) -> TieredConnector | None:
    """The connector for `config`'s tiers and role, or None when it asks for none.

    `block_shape` is one block's K (or V) across layers: (layers, block size, KV heads,
    head dim), as the device cache's [:, block_id] gives it."""
    if not config.has_kv_tiers:
        return None
    policy = eviction_factory(config.kv_host_eviction, config.seed)()
    fingerprint = layout_fingerprint(model_identity(model_path), dtype, block_shape)
    # Loads from disk or Redis are staged in host memory before the device copies them:
    # with a lower tier the host tier holds at least a device pool's worth, so one
    # request's prefetched run is not evicted by its own tail before it is used.
    num_slots = config.kv_host_blocks
    if config.kv_disk_path or config.kv_shared_url or config.role != "both":
        num_slots = max(num_slots, num_device_blocks)
    host = HostTier(
        num_slots,
        block_shape,
        dtype,
        pin_memory=config.device == "cuda",
        policy=policy,
    )
    disk = None
    if config.kv_disk_path:
        disk = DiskTier(config.kv_disk_path, int(config.kv_disk_gib * 2**30), fingerprint)
    shared = None
    if config.kv_shared_url:
        from once.engine.kv.shared_tier import SharedTier

        shared = SharedTier(config.kv_shared_url, fingerprint, ttl_s=config.kv_shared_ttl_s)
    transfer: TransferStore | PeerSet | None = None
    kind: type[TieredConnector] = TieredConnector
    if config.role == "prefill":
        transfer = TransferStore(config.kv_transfer_blocks or 2 * num_device_blocks)
        if config.kv_transfer == "tcp":
            transfer.serve_tcp(config.kv_transfer_host, config.kv_transfer_port)
        kind = PrefillConnector
    elif config.role == "decode":
        transfer = PeerSet()  # filled from the requests' kv_transfer_params
        kind = DecodeConnector
    return kind(
        host,
        fingerprint,
        disk=disk,
        shared=shared,
        transfer=transfer,
        write_mode=config.kv_offload,
        block_size=config.block_size,
    )
