"""State pytrees. Every piece of state is passed in and returned: no hidden mutation.

Shape legend: S slots, Hv value heads, K/V head dims, Kc conv kernel size, N streams in a call.

Updates are functional (``pool.at[slot_ids].set(...)``) so callers can donate the buffers under ``jax.jit``.
A slot whose ``has_initial_state`` is False starts from zeros whatever stale contents it holds.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from jax_gdn.config import GdnDims


@struct.dataclass
class GdnSlots:
    """Slot pools of one GDN layer.

    conv_state: [S, conv_dim, Kc - 1]  the last Kc - 1 pre-conv inputs of each slot (activation dtype)
    ssm_state:  [S, Hv, K, V] fp32     the recurrent state of each slot
    """

    conv_state: jax.Array
    ssm_state: jax.Array

    @classmethod
    def zeros(cls, dims: GdnDims, num_slots: int, dtype=jnp.float32) -> "GdnSlots":
        return cls(
            conv_state=jnp.zeros((num_slots, dims.conv_dim, dims.conv_kernel_size - 1), dtype),
            ssm_state=jnp.zeros((num_slots, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim),
                                jnp.float32),
        )

    @property
    def num_slots(self) -> int:
        return self.ssm_state.shape[0]


@struct.dataclass
class BatchMeta:
    """Metadata of one packed batch of N streams over T stacked tokens.

    cu_seqlens:        [N + 1] int32  stream n owns tokens cu_seqlens[n]:cu_seqlens[n+1]
    slot_ids:          [N] int32      the state slot of each stream
    has_initial_state: [N] bool       False: the stream starts fresh (slot contents ignored)
    positions:         [N] int32      tokens each stream already has (0 for a fresh stream)
    """

    cu_seqlens: jax.Array
    slot_ids: jax.Array
    has_initial_state: jax.Array
    positions: jax.Array

    @classmethod
    def from_lengths(cls, lengths, slot_ids=None, positions=None) -> "BatchMeta":
        lengths = jnp.asarray(lengths, jnp.int32)
        n = lengths.shape[0]
        cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths, dtype=jnp.int32)])
        slot_ids = jnp.arange(n, dtype=jnp.int32) if slot_ids is None else jnp.asarray(slot_ids, jnp.int32)
        positions = jnp.zeros((n,), jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
        return cls(cu_seqlens=cu, slot_ids=slot_ids, has_initial_state=positions > 0, positions=positions)

    @property
    def num_seqs(self) -> int:
        return self.slot_ids.shape[0]


# ----------------------------------------------------------------------------------------------------------------
# KV pages and the whole-model cache
#   P pages in the pool, Ps tokens per page, Hkv kv heads, Dh head dim, S slots, W pages per slot,
#   Lg / La GDN / attention layers of the model
# ----------------------------------------------------------------------------------------------------------------


@struct.dataclass
class KvPages:
    """Paged K/V of one attention layer; which page belongs to whom lives in :class:`Cache` (shared by layers).

    k_pages: [P, Ps, Hkv, Dh]  (activation dtype)
    v_pages: [P, Ps, Hkv, Dh]
    """

    k_pages: jax.Array
    v_pages: jax.Array

    @classmethod
    def zeros(cls, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32):
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return cls(k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype))

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]


@struct.dataclass
class Cache:
    """Everything a hybrid model carries between calls, as one pytree (donated to prefill / decode / release).

    gdn:        GdnSlots with every leaf stacked over the GDN layers (in layer order):
                conv_state [Lg, S, conv_dim, Kc - 1], ssm_state [Lg, S, Hv, K, V] fp32
    kv:         KvPages stacked over the attention layers: k_pages, v_pages [La, P, Ps, Hkv, Dh]
    page_table: [S, W] int32  page_table[s, i] is the pool page holding tokens i*Ps .. i*Ps+Ps-1 of slot s
                              (valid for i < ceil(slot_lens[s] / Ps)); a slot holds at most max_seq_len tokens
    page_refs:  [P] int32     how many slots' page tables hold each page (0: free; > 1: a full page shared by
                              forks, e.g. a cached prefix and the requests started from it; never written again)
    slot_lens:  [S] int32     tokens each slot holds (0: empty, the next prefill starts it fresh)
    status:     [] int32      0, or why a step was refused (1 out of KV pages, 2 a slot past max_seq_len);
                              sticky until cleared (jax_gdn.model.HybridModel.check)
    page_size:  Ps (static)
    max_seq_len: (static) the most tokens a slot may hold; None: W * Ps (``seq_len_limit`` is the one in force)
    """

    gdn: GdnSlots
    kv: KvPages
    page_table: jax.Array
    page_refs: jax.Array
    slot_lens: jax.Array
    status: jax.Array
    page_size: int = struct.field(pytree_node=False, default=16)
    max_seq_len: Optional[int] = struct.field(pytree_node=False, default=None)

    @property
    def num_slots(self) -> int:
        return self.slot_lens.shape[0]

    @property
    def num_pages(self) -> int:
        return self.page_refs.shape[0]

    @property
    def pages_per_slot(self) -> int:
        return self.page_table.shape[1]

    @property
    def seq_len_limit(self) -> int:
        """The most tokens a slot may hold: max_seq_len, and never more than its W pages hold."""
        cap = self.pages_per_slot * self.page_size
        return cap if self.max_seq_len is None else min(int(self.max_seq_len), cap)
