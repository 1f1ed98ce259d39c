"""Re-export of ``pallas_kernels.gated_delta_rule.chunk_map`` (the chunk map from cu_seqlens, ``token_streams``,
the slot-pool gather / scatter of the padding contract); the model imports ``token_streams`` from here."""
from pallas_kernels.gated_delta_rule.chunk_map import (ChunkMap, build_chunk_map, dense_chunk_map,  # noqa: F401
                                                       dense_cu_seqlens, gather_slots, kernel_chunk_map, max_chunks,
                                                       scatter_slots, slot_mask, token_streams)
