"""An exact prefix cache for hybrid (GDN + attention) models.

A GDN layer's state after n tokens is one [Hv, K, V] matrix per slot, not a per-token cache: a prefix can be
reused only from a state taken exactly at its end. So the cache keeps **snapshots** of a request's slot
(``HybridModel.fork``: the GDN conv and recurrent states, the slot length, and its KV pages, the full ones shared
by reference count and a partial last one copied) taken at a boundary of the block grid (block_size tokens),
keyed by the hash chain of the prompt's token blocks. A later request whose sequence starts with a cached prefix
(the longest one that leaves at least one token to feed) gets the snapshot forked into its own slot and feeds only
the rest: the same state and KV a cold run would have made, so its outputs are the cold run's (within the
rounding of a different chunking).

Which boundaries (branch points, as a radix tree would keep them): each block boundary a prompt passes is
counted (a sighting); a boundary is **wanted** once this is its ``min_uses``-th sighting (default 2: a second
request shows the prefix is shared) and no entry holds it. A prompt chunk is cut only at the end of a run of
wanted boundaries (the deepest wanted boundary whose next one is not wanted: where this prompt leaves the
prefixes seen before), so a prompt sharing nothing is chunked as without the cache, and a shared system prompt
gets one snapshot at its last block boundary, not one per block. Prefixes shared at two depths (a system prompt,
then few-shot examples shared by some requests) get a snapshot at each branch point once a request shows it.
Each snapshot holds a slot (its GDN state) and references to its KV pages (out of the pool while it lives).

Host side, per entry: the chain hash of its blocks (sha1 over the previous hash and the block's token bytes),
its tokens (compared on a hit, so a hash collision can never hand out a wrong state), its snapshot slot and its
last use. Snapshot slots are a fixed set of the cache's slots that never run a request; when they are all taken
the least recently used entry is evicted (its slot released). Counters: lookups, hits, hit_tokens, snapshots,
evictions.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Optional

import numpy as np

__all__ = ["PrefixCache", "block_hashes"]


def block_hashes(tokens: np.ndarray, block_size: int, upto: Optional[int] = None) -> list:
    """The chain hashes of the full blocks of ``tokens[:upto]``: entry i covers tokens [0, (i + 1) block_size)."""
    tokens = np.asarray(tokens, np.int32)
    n = (tokens.shape[0] if upto is None else min(int(upto), tokens.shape[0])) // block_size
    out, h = [], b""
    for i in range(n):
        h = hashlib.sha1(h + tokens[i * block_size:(i + 1) * block_size].tobytes()).digest()
        out.append(h)
    return out


@dataclasses.dataclass
class _Entry:
    slot: int
    tokens: np.ndarray


class PrefixCache:
    """The host side of the prefix cache (module docstring): which snapshot slot holds which prefix.

    block_size: tokens per block (the snapshot grid); slots: the cache's snapshot slot ids; min_uses: a boundary
    is snapshotted once this many prompts have reached it."""

    SEEN_MAX = 1 << 16            # boundary hashes remembered for min_uses (least recently seen forgotten first)

    def __init__(self, block_size: int, slots, min_uses: int = 2):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"PrefixCache: block_size must be a positive int; got {block_size!r}")
        self.block_size = block_size
        self.free = list(slots)
        if not self.free:
            raise ValueError("PrefixCache: needs at least one snapshot slot")
        if not isinstance(min_uses, int) or isinstance(min_uses, bool) or min_uses < 1:
            raise ValueError(f"PrefixCache: min_uses must be a positive int; got {min_uses!r}")
        self.min_uses = min_uses
        self.entries: "collections.OrderedDict[bytes, _Entry]" = collections.OrderedDict()    # LRU order
        self.seen: "collections.OrderedDict[bytes, int]" = collections.OrderedDict()
        self.stats = collections.Counter()

    def lookup(self, tokens: np.ndarray, max_len: int):
        """(snapshot slot, prefix length) of the longest cached prefix of ``tokens`` no longer than ``max_len``,
        or None. Counts a lookup, and a hit with its tokens."""
        self.stats["lookups"] += 1
        hashes = block_hashes(tokens, self.block_size, max_len)
        for i in range(len(hashes) - 1, -1, -1):
            e = self.entries.get(hashes[i])
            n = (i + 1) * self.block_size
            if e is not None and e.tokens.shape[0] == n and np.array_equal(e.tokens, tokens[:n]):
                self.entries.move_to_end(hashes[i])
                self.stats["hits"] += 1
                self.stats["hit_tokens"] += n
                return e.slot, n
        return None

    def _wanted(self, key: bytes, pending) -> bool:
        """key's next sighting (after those in ``pending``, a Counter of this step's earlier chunks) would be its
        min_uses-th or later, and no entry holds it."""
        return key not in self.entries and self.seen.get(key, 0) + pending.get(key, 0) + 1 >= self.min_uses

    def cut(self, keys: list, lo: int, hi: int, pending) -> int:
        """Where a prompt chunk that would feed tokens [lo, hi) ends: at the end of a run of wanted boundaries in
        (lo, hi] (module docstring), else hi. ``keys``: the prompt's block chain hashes (``block_hashes``);
        ``pending``: this step's earlier chunks' sightings (a Counter; the caller adds this chunk's)."""
        bs = self.block_size
        b = min(hi, len(keys) * bs) // bs * bs           # the deepest prompt boundary <= hi
        while b > lo:
            i = b // bs - 1
            if self._wanted(keys[i], pending):
                if i + 1 < len(keys) and self._wanted(keys[i + 1], pending):
                    return hi                             # the shared run goes on past this chunk
                return b
            b -= bs
        return hi

    def passed(self, keys: list, lo: int, hi: int) -> list:
        """The keys of the prompt boundaries in (lo, hi]."""
        bs = self.block_size
        return keys[lo // bs:min(hi // bs, len(keys))]

    def reach(self, keys: list, lo: int, hi: int) -> Optional[bytes]:
        """A prompt chunk has fed tokens [lo, hi) (``keys`` as in :meth:`cut`): counts a sighting of each boundary
        in (lo, hi]; returns the key under which to snapshot the slot now (hi a prompt boundary, wanted), else
        None."""
        for key in self.passed(keys, lo, hi):
            uses = self.seen.pop(key, 0) + 1
            self.seen[key] = uses
        while len(self.seen) > self.SEEN_MAX:
            self.seen.popitem(last=False)
        if hi <= 0 or hi % self.block_size or hi // self.block_size > len(keys):
            return None
        key = keys[hi // self.block_size - 1]
        return None if key in self.entries or self.seen[key] < self.min_uses else key

    def take_slot(self) -> int:
        """A snapshot slot for a new entry: a free one, else the least recently used entry's (evicted; the fork
        into it frees its pages)."""
        if not self.free:
            self.evict_lru()
        return self.free.pop(0)

    def insert(self, key: bytes, slot: int, tokens: np.ndarray) -> None:
        self.entries[key] = _Entry(slot, np.asarray(tokens, np.int32).copy())
        self.stats["snapshots"] += 1

    def give_back(self, slot: int) -> None:
        """A taken slot that got no entry (its snapshot was refused)."""
        self.free.append(slot)

    def evict_lru(self):
        """Evicts the least recently used entry; returns its slot (to release) or None when empty."""
        if not self.entries:
            return None
        _, e = self.entries.popitem(last=False)
        self.stats["evictions"] += 1
        self.free.append(e.slot)
        return e.slot

    @property
    def hit_rate(self) -> float:
        return self.stats["hits"] / self.stats["lookups"] if self.stats["lookups"] else 0.0
