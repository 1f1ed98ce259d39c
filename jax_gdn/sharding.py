"""Mesh rules of the hybrid model: which axis of each parameter and cache leaf is split over the devices.

Shape legend: n devices on the mesh axis, D hidden size, Vocab vocabulary, Hk / Hv GDN key / value heads
(r = Hv / Hk), K / V GDN head dims, C = 2 Hk K + Hv V conv channels, H / Hkv attention query / kv heads, Dh
attention head dim, E experts, I per-expert intermediate size, Is shared-expert intermediate size, R repeats of
the layer period (the leading axis of stacked leaves), S slots, P KV pages, Ps tokens per page.

The scheme is tensor parallelism over heads (Megatron style), run as ONE program per device: the model's whole
step runs inside ``jax.shard_map`` over a one-axis mesh (any axis name, ``jax.make_mesh((2,), ("model",))``), each
device holding its slice of every split leaf and running the unchanged block code (and the Pallas kernels) on a
*local* config whose head / intermediate / vocabulary counts are divided by n (``ShardRules.local_config``; with
expert parallel the experts' I is kept and each device holds E/n whole experts). The only communication is one
``psum`` after each row-parallel projection (the mixer's out_proj / o_proj, the FFN's down projection or the
experts' partial sums: two per block) and one for the vocabulary-split embedding lookup.

Device i holds (ranges below are in the one-device layout; the sharded global array is the devices' slices
concatenated, "device-major"):

========================  =======================================================================================
leaf                      split
========================  =======================================================================================
embed [Vocab, D]          rows i Vocab/n ... (a lookup reads zeros for ids of other devices, then psum);
lm_head [D, Vocab]        columns likewise: logits come out split over the vocabulary [N, Vocab] (P(None, axis)).
                          Replicated when n does not divide Vocab.
GDN in_proj_qkvz          key heads [i Hk/n, (i+1) Hk/n) with their value heads: the fused per-key-head
  [D, Hk (2K + 2rV)]      ``[q|k|v*r|z*r]`` blocks are contiguous, so a key-head group is one column range
GDN in_proj_ba [D, 2 Hv]  per key head ``[b*r|a*r]``: one column range per group
GDN in_proj_qkv [D, C],   the three segments q [Hk K], k [Hk K], v [Hv V], each split by heads: device i holds
conv1d [C, Kc]            ``[q_i | k_i | v_i]`` (three ranges; the sharded layout is reordered device-major)
in_proj_z / b / a,        value heads [i Hv/n, (i+1) Hv/n)
A_log, dt_bias
out_proj [Hv V, D]        rows of its value heads (row-parallel: partial sums, one psum)
attention q_proj          query heads [i H/n, ...) (per head ``[query|gate]``, contiguous)
k_proj, v_proj            kv heads [i Hkv/n, ...); when n > Hkv (n a multiple of Hkv) device i holds a copy of
  [D, Hkv Dh]             the one kv head its query heads read, i Hkv // n (stored [D, n Dh]: replicated heads)
o_proj [H Dh, D]          rows of its query heads (row-parallel, one psum)
MoE experts_gate_up       moe_sharding "tensor": tensor parallel inside every expert: columns
  [E, D, 2I]              [i I/n, ...) of gate AND of up (two ranges; device-major ``[gate_i | up_i]``);
                          "expert" (the default "auto" where n divides E): the whole experts [i E/n, (i+1) E/n)
experts_down [E, I, D]    "tensor": rows [i I/n, ...) (row-parallel; the routed and the shared expert share one
                          psum); "expert": the whole experts [i E/n, ...) (their partial sums join the same psum)
shared expert, dense MLP  gate_proj / up_proj columns, down_proj rows
norms, router,            replicated
shared_expert_gate
========================  =======================================================================================

Cache: conv_state [Lg, S, C, Kc-1] split on C like conv1d (device-major), ssm_state [Lg, S, Hv, K, V] on Hv,
k_pages / v_pages [La, P, Ps, Hkv', Dh] on the kv heads (Hkv' = max(Hkv, n): replicated heads when n > Hkv);
page_table, page_refs, slot_lens, status replicated (every device runs the same allocation).

Two ways to split the routed experts (``moe_sharding``), both with no token exchange: after the mixer's psum the
tokens are replicated, every device routes every token itself (the router is replicated, so the routing is the
same everywhere) and the FFN's one psum joins the devices' partial sums.
* "tensor": every device runs the unchanged grouped-GEMM MoE on its I/n columns of all E experts: the
  same rows on every device, balanced by construction, but the GEMMs run at width 2I/n, I/n and the sort, the
  down projection's [T k, D] output and the combine's gather of it are repeated on every device in full.
* "expert" (``jax_gdn.layers.moe_ep``): device i keeps the token copies routed to its E/n whole experts and runs
  the grouped GEMMs at full width on them (the other copies go to a trash expert whose blocks the kernels skip):
  GEMM work, the [T k, D] output and the combine halve with n; routing and the sort are still repeated; a device
  whose experts are hot gets more rows (random weights: balanced; real checkpoints: hot experts decide).
"auto" (the default) picks "expert" where the mesh divides the experts, "tensor" otherwise: on two H200s at 80B
dims expert parallel measured 5% faster on prefill and the same on decode (rows with moe_sharding "tensor" /
"expert" in benchmarks/results/h200x2.json; ``docs/sharding.md``). Decode reads 1/n of the hit experts'
bytes per device either way (weight-bandwidth bound).

Errors: ``ShardRules(config, mesh, moe_sharding)`` raises ValueError naming the mesh size and the head /
intermediate / expert counts it does not divide, before anything is placed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_gdn.config import GdnDims, HybridConfig
from jax_gdn.state import Cache

__all__ = ["Split", "ShardRules", "embed_lookup", "MOE_SHARDINGS", "resolve_moe_sharding"]

#: how the routed experts are split: "tensor" (columns of every expert) or "expert" (whole experts)
MOE_SHARDINGS = ("auto", "tensor", "expert")


def resolve_moe_sharding(config: HybridConfig, n: int, moe_sharding: str) -> str:
    """"auto" (the default) -> "expert" when the model has MoE layers and ``n`` divides num_experts, else
    "tensor"; "tensor" / "expert" as given. Measured on two H200s at Qwen3-Next-80B dims, 12 layers
    (benchmarks/results/h200x2.json): varlen16 prefill 61.3 ms expert / 64.8 ms tensor (1 GPU: 91.0),
    decode 64 streams 9.31 / 9.24 ms (1 GPU: 12.39): expert parallel halves the grouped GEMMs' work and their
    [T k, D] output per device, tensor parallel repeats both at half width."""
    if moe_sharding not in MOE_SHARDINGS:
        raise ValueError(f"moe_sharding must be one of {MOE_SHARDINGS}, got {moe_sharding!r}")
    if moe_sharding != "auto":
        return moe_sharding
    has_moe = any(config.layer_is_moe(i) for i in range(config.num_hidden_layers))
    return "expert" if has_moe and config.num_experts % n == 0 else "tensor"


@dataclasses.dataclass(frozen=True)
class Split:
    """How one (unstacked) leaf is split: ``axis`` and, per device, the ranges ``((start, stop), ...)`` along it in
    the one-device layout whose concatenation is that device's slice."""

    axis: int
    ranges: tuple

    @property
    def local_size(self) -> int:
        return sum(b - a for a, b in self.ranges[0])

    def index(self) -> np.ndarray:
        """The one-device positions of the sharded (device-major) layout along ``axis``."""
        return np.concatenate([np.arange(a, b) for rs in self.ranges for a, b in rs]).astype(np.int32)

    def is_identity(self, size: int) -> bool:
        return self.index().shape[0] == size and bool(np.all(self.index() == np.arange(size)))


def _contiguous(size: int, n: int) -> tuple:
    c = size // n
    return tuple(((i * c, (i + 1) * c),) for i in range(n))


def _segments(sizes, n: int) -> tuple:
    """Consecutive segments of the given sizes, each split in n: device i holds chunk i of every segment."""
    offs = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return tuple(tuple((int(offs[s] + i * sizes[s] // n), int(offs[s] + (i + 1) * sizes[s] // n))
                       for s in range(len(sizes))) for i in range(n))


_GDN_PROBE_HIDDEN = 1009   # a prime no other probe dim equals: finds the hidden axis of each GDN weight


def gdn_hidden_axis(layout: str) -> dict:
    """name -> axis holding D in jax_gdn.layers.gdn's parameter layout (read from ``param_shapes``, so a change
    of layout there ([out, in] vs [in, out]) is followed here)."""
    from jax_gdn.layers import gdn as gdn_layer
    probe = GdnDims(hidden_size=_GDN_PROBE_HIDDEN, num_k_heads=2, num_v_heads=4, head_k_dim=3, head_v_dim=5,
                    conv_kernel_size=4, layout=layout)
    return {name: shape.index(_GDN_PROBE_HIDDEN) for name, shape in gdn_layer.param_shapes(probe).items()
            if len(shape) == 2 and _GDN_PROBE_HIDDEN in shape}


def embed_lookup(table: jax.Array, ids: jax.Array, axis_name: Optional[str], vocab_split: bool) -> jax.Array:
    """table [Vocab(/n), D], ids [T] -> [T, D]. Vocabulary split: each device looks up the ids of its rows (zeros
    for the others) and one psum joins them (exact: a single device contributes each row)."""
    if axis_name is None or not vocab_split:
        return table[ids]
    v = table.shape[0]
    local = ids - jax.lax.axis_index(axis_name) * v
    mine = (local >= 0) & (local < v)
    rows = table[jnp.clip(local, 0, v - 1)]
    return jax.lax.psum(jnp.where(mine[:, None], rows, jnp.zeros((), rows.dtype)), axis_name)


class ShardRules:
    """The mesh rules for one model config on one mesh (see the module docstring).

    mesh: a one-axis ``jax.sharding.Mesh`` (any axis name). moe_sharding: "tensor" (every device holds I / n
    columns of every expert), "expert" (device i holds the whole experts [i E / n, (i + 1) E / n);
    ``jax_gdn.layers.moe_ep``) or "auto" (default: ``resolve_moe_sharding``, expert where n divides E); the
    resolved choice is ``self.moe_sharding``. Raises ValueError when the mesh has more than one axis, when
    moe_sharding is none of these, or when the mesh size does not divide the head / intermediate / expert counts the
    model splits.
    """

    def __init__(self, config: HybridConfig, mesh: jax.sharding.Mesh, moe_sharding: str = "auto"):
        if moe_sharding not in MOE_SHARDINGS:
            raise ValueError(f"moe_sharding must be one of {MOE_SHARDINGS}, got {moe_sharding!r}")
        if not isinstance(mesh, jax.sharding.Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((2,), ('model',))), got "
                             f"{type(mesh).__name__}")
        if len(mesh.axis_names) != 1:
            raise ValueError(f"mesh must have one axis (heads, experts' columns and vocabulary are all split over "
                             f"it); got axes {mesh.axis_names} of sizes {tuple(mesh.shape.values())}")
        self.config = config
        self.mesh = mesh
        self.axis = mesh.axis_names[0]
        n = self.n = int(mesh.shape[self.axis])
        moe_sharding = self.moe_sharding = resolve_moe_sharding(config, n, moe_sharding)
        c = config
        bad = []
        if c.gdn_layers and c.linear_num_key_heads % n:
            bad.append(f"GDN key heads linear_num_key_heads={c.linear_num_key_heads} (value heads "
                       f"linear_num_value_heads={c.linear_num_value_heads} follow their key heads)")
        if c.attn_layers:
            if c.num_attention_heads % n:
                bad.append(f"attention heads num_attention_heads={c.num_attention_heads}")
            hkv = c.num_key_value_heads
            if hkv % n and n % hkv:
                bad.append(f"kv heads num_key_value_heads={hkv} (n must divide them, or be a multiple of them: "
                           f"then each device keeps a copy of the kv head its query heads read)")
        kinds = [c.layer_is_moe(i) for i in range(c.num_hidden_layers)]
        if any(kinds):
            if moe_sharding == "expert" and c.num_experts % n:
                bad.append(f"experts num_experts={c.num_experts} (expert parallel: E / n whole experts per "
                           f"device)")
            if moe_sharding == "tensor" and c.moe_intermediate_size % n:
                bad.append(f"MoE intermediate size moe_intermediate_size={c.moe_intermediate_size} (tensor "
                           f"parallel inside each of the {c.num_experts} experts)")
            if c.shared_expert_intermediate_size % n:
                bad.append(f"shared_expert_intermediate_size={c.shared_expert_intermediate_size}")
        if not all(kinds) and c.intermediate_size % n:
            bad.append(f"dense MLP intermediate_size={c.intermediate_size}")
        if bad:
            raise ValueError(f"mesh axis {self.axis!r} has {n} devices, which does not divide: " + "; ".join(bad)
                             + f". Use a device count dividing them (this model: GDN key heads "
                               f"{c.linear_num_key_heads}, attention heads {c.num_attention_heads}, kv heads "
                               f"{c.num_key_value_heads}, experts {c.num_experts}).")
        self.vocab_split = c.vocab_size % n == 0
        self.kv_heads = max(c.num_key_value_heads, n) if c.attn_layers else c.num_key_value_heads
        self._gdn_hidden = gdn_hidden_axis(c.gdn_layout)

    # ---- configs ---------------------------------------------------------------------------------------------
    @property
    def expert_parallel(self) -> bool:
        """True when the routed experts are split whole over the axis (moe_sharding "expert")."""
        return self.moe_sharding == "expert"

    @property
    def local_config(self) -> HybridConfig:
        """The config each device's program runs: head, intermediate and vocabulary counts divided by n."""
        c, n = self.config, self.n
        kw = dict(linear_num_key_heads=c.linear_num_key_heads // n if c.gdn_layers else c.linear_num_key_heads,
                  linear_num_value_heads=(c.linear_num_value_heads // n if c.gdn_layers
                                          else c.linear_num_value_heads))
        if c.attn_layers:
            kw.update(num_attention_heads=c.num_attention_heads // n, num_key_value_heads=self.kv_heads // n)
        if c.intermediate_size % n == 0:
            kw["intermediate_size"] = c.intermediate_size // n
        if c.num_experts:   # expert parallel: whole experts (I unchanged), E stays the router's width
            kw.update(moe_intermediate_size=(c.moe_intermediate_size if self.expert_parallel
                                             else c.moe_intermediate_size // n),
                      shared_expert_intermediate_size=c.shared_expert_intermediate_size // n)
        if self.vocab_split:
            kw["vocab_size"] = c.vocab_size // n
        return dataclasses.replace(c, **kw)

    # ---- parameters ------------------------------------------------------------------------------------------
    def split(self, name: str, shape: tuple) -> Optional[Split]:
        """The split of an unstacked parameter leaf named ``name`` (its dict key) of one-device ``shape``; None:
        replicated."""
        c, n = self.config, self.n
        if name in ("embed", "lm_head"):
            if not self.vocab_split:
                return None
            ax = 0 if name == "embed" else 1
            return Split(ax, _contiguous(shape[ax], n))
        if name in self._gdn_hidden and len(shape) == 2:                        # GDN linear weights
            ax = 1 - self._gdn_hidden[name]
            if name == "in_proj_qkv":
                d = c.gdn_dims
                return Split(ax, _segments([d.key_dim, d.key_dim, d.value_dim], n))
            return Split(ax, _contiguous(shape[ax], n))
        if name == "conv1d":
            d = c.gdn_dims
            return Split(0, _segments([d.key_dim, d.key_dim, d.value_dim], n))
        if name in ("A_log", "dt_bias"):
            return Split(0, _contiguous(shape[0], n))
        if name == "q_proj" or name in ("gate_proj", "up_proj"):
            return Split(1, _contiguous(shape[1], n))
        if name in ("o_proj", "down_proj"):
            return Split(0, _contiguous(shape[0], n))
        if name in ("k_proj", "v_proj"):
            hkv, dh = c.num_key_value_heads, c.head_dim
            if n <= hkv:
                return Split(1, _contiguous(shape[1], n))
            return Split(1, tuple((((i * hkv // n) * dh, (i * hkv // n + 1) * dh),) for i in range(n)))
        if name in ("experts_gate_up", "experts_down") and self.expert_parallel:
            return Split(0, _contiguous(shape[0], n))                           # whole experts
        if name == "experts_gate_up":
            i2 = shape[2]
            return Split(2, _segments([i2 // 2, i2 // 2], n))
        if name == "experts_down":
            return Split(1, _contiguous(shape[1], n))
        return None

    @staticmethod
    def leaf_name(path) -> tuple[str, int]:
        """(name, lead) of a leaf of the model's params pytree: lead 1 for leaves stacked over the period."""
        keys = [p.key if hasattr(p, "key") else p.idx for p in path]
        lead = 1 if keys and keys[0] == "period" else 0
        return keys[-1], lead

    def leaf_spec(self, name: str, x, lead: int) -> P:
        """The PartitionSpec of a params leaf named ``name`` (``lead`` stacked axes before its one-device shape)."""
        s = self.split(name, tuple(x.shape[lead:]))
        return P() if s is None else P(*([None] * (lead + s.axis) + [self.axis]))

    def _placed_shape(self, name: str, x, lead: int) -> tuple:
        """x's shape in the sharded layout, whether x is one-device or already sharded (kv heads replicated)."""
        shape = tuple(x.shape)
        if name in ("k_proj", "v_proj") and self.n > self.config.num_key_value_heads:
            return shape[:lead + 1] + (self.n * self.config.head_dim,)
        return shape

    def param_specs(self, params) -> dict:
        """PartitionSpec of every leaf of the model's (stacked) params."""
        def spec(path, x):
            name, lead = self.leaf_name(path)
            return self.leaf_spec(name, x, lead)
        return jax.tree_util.tree_map_with_path(spec, params)

    def sharded_shape(self, name: str, shape: tuple, lead: int = 0) -> tuple:
        """The global shape of a leaf in the sharded layout (differs from ``shape`` only for replicated kv heads)."""
        s = self.split(name, tuple(shape[lead:]))
        if s is None:
            return tuple(shape)
        out = list(shape)
        out[lead + s.axis] = s.local_size * self.n
        return tuple(out)

    def place_params(self, params) -> dict:
        """One-device params -> the sharded layout on the mesh. Device arrays: reordered on their device (only
        the leaves whose layout changes) and sent slice by slice with ``jax.device_put`` (device to device);
        host arrays: each device receives only its slice (``jax.make_array_from_callback``, reorder per slice)."""
        def place(path, x):
            name, lead = self.leaf_name(path)
            s = self.split(name, tuple(x.shape[lead:]))
            spec = P() if s is None else P(*([None] * (lead + s.axis) + [self.axis]))
            sharding = NamedSharding(self.mesh, spec)
            if s is None:
                return jax.device_put(x, sharding)
            ax = lead + s.axis
            if isinstance(x, jax.Array):
                if not s.is_identity(x.shape[ax]):
                    x = jnp.take(x, jnp.asarray(s.index()), axis=ax)
                return jax.device_put(x, sharding)
            shape = self.sharded_shape(name, tuple(x.shape), lead)
            local = s.local_size

            def piece(index):
                dev = (index[ax].start or 0) // local
                cut = [slice(None)] * x.ndim
                parts = []
                for a, b in s.ranges[dev]:
                    cut[ax] = slice(a, b)
                    parts.append(np.asarray(x[tuple(cut)]))
                return np.concatenate(parts, axis=ax)
            return jax.make_array_from_callback(shape, sharding, piece)
        return jax.tree_util.tree_map_with_path(place, params)

    def param_shardings(self, params):
        return jax.tree.map(lambda sp: NamedSharding(self.mesh, sp), self.param_specs(params))

    def is_placed(self, params) -> bool:
        """True when every leaf already is a jax.Array with this mesh's sharding and the sharded layout's shape
        (what ``place_params``, ``random_params`` and the sharded loader return)."""
        def ok(path, x):
            name, lead = self.leaf_name(path)
            want = NamedSharding(self.mesh, self.leaf_spec(name, x, lead))
            return (isinstance(x, jax.Array) and tuple(x.shape) == self._placed_shape(name, x, lead)
                    and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self.mesh
                    and x.sharding.is_equivalent_to(want, x.ndim))
        return all(jax.tree.leaves(jax.tree_util.tree_map_with_path(ok, params)))

    def ensure_placed(self, params) -> dict:
        """Params in the sharded layout on the mesh: returned as they are when ``is_placed``, else taken as the
        one-device layout and placed (``place_params``)."""
        return params if self.is_placed(params) else self.place_params(params)

    def random_params(self, make: Callable[[], dict]) -> dict:
        """``make()`` (traced once) builds one-device random params; they are made on the devices already split
        (jit with out_shardings: each device generates its slice) in the sharded layout. Values equal
        ``place_params(make())`` except where the sharded layout reorders columns of iid random leaves (conv1d,
        in_proj_qkv, experts_gate_up: the same distribution, not reordered); replicated kv heads are copies."""
        abstract = jax.eval_shape(make)
        hkv = self.config.num_key_value_heads

        def build():
            def relayout(path, x):
                name, lead = self.leaf_name(path)
                if name in ("k_proj", "v_proj") and self.n > hkv:
                    s = self.split(name, tuple(x.shape[lead:]))
                    return jnp.take(x, jnp.asarray(s.index()), axis=lead + s.axis)
                return x
            return jax.tree_util.tree_map_with_path(relayout, make())
        return jax.jit(build, out_shardings=self.param_shardings(abstract))()

    # ---- cache -----------------------------------------------------------------------------------------------
    def cache_specs(self, cache: Cache) -> Cache:
        """PartitionSpecs of a Cache: GDN state by head (conv channels device-major), KV pages by kv head, the
        tables replicated."""
        a = self.axis
        gdn = cache.gdn.replace(conv_state=P(None, None, a, None), ssm_state=P(None, None, a, None, None))
        kv = cache.kv.replace(k_pages=P(None, None, None, a, None), v_pages=P(None, None, None, a, None))
        return cache.replace(gdn=gdn, kv=kv, page_table=P(), page_refs=P(), slot_lens=P(),
                             status=P())

    def cache_shardings(self, cache: Cache) -> Cache:
        return jax.tree.map(lambda sp: NamedSharding(self.mesh, sp), self.cache_specs(cache))

    # ---- the sharded program -----------------------------------------------------------------------------------
    def logits_spec(self) -> P:
        return P(None, self.axis) if self.vocab_split else P()

    def shard_step(self, fn: Callable, *, with_params: bool = True) -> Callable:
        """Wraps ``fn(params, cache, *replicated_arrays, **static) -> (logits, cache)`` (or ``fn(cache, *arrays)
        -> cache`` with ``with_params=False``) into ``jax.shard_map`` over the mesh: params and cache by their
        specs, the int32 call arrays replicated, ``axis_name`` passed to ``fn``."""
        mesh, axis = self.mesh, self.axis

        def wrapped(*args, **static):
            if with_params:
                params, cache, rest = args[0], args[1], args[2:]
                in_specs = (self.param_specs(params), self.cache_specs(cache)) + (P(),) * len(rest)
                out_specs = (self.logits_spec(), self.cache_specs(cache))
            else:
                cache, rest = args[0], args[1:]
                in_specs = (self.cache_specs(cache),) + (P(),) * len(rest)
                out_specs = self.cache_specs(cache)

            def body(*a):
                return fn(*a, axis_name=axis, **static)
            return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
        return wrapped

    def __repr__(self):
        return (f"ShardRules(axis={self.axis!r}, n={self.n}, vocab_split={self.vocab_split}, "
                f"kv_heads={self.kv_heads}, moe_sharding={self.moe_sharding!r})")
