"""Re-export of ``pallas_kernels.gated_delta_rule.chunk_map`` (the chunk map from cu_seqlens, ``token_streams``,
the slot-pool gather / scatter of the padding contract, ``count_le``); the model imports ``token_streams`` and
``count_le`` from here."""
from pallas_kernels.gated_delta_rule.chunk_map import (  # noqa: F401
    ChunkMap, build_chunk_map, count_le, dense_chunk_map, dense_cu_seqlens, gather_slots, kernel_chunk_map,
    max_chunks, scatter_slots, slot_mask, token_streams)
