"""Token-bucket ladders against prompt-length mixes: buckets used (compiled programs per N bucket) and padded
tokens (wasted prefill work). No device work; the numbers behind HybridModel's default ladder.

    python benchmarks/bucket_ladders.py
"""
from __future__ import annotations

import numpy as np

from jax_gdn.model import default_token_buckets

LADDERS = {
    "default: 16..1024 pow2, then x1024": default_token_buckets(65536),
    "16..256 pow2, x256 to 4096, then x1024": tuple([16 << i for i in range(5)] + list(range(512, 4097, 256))
                                                    + list(range(5120, 65537, 1024))),
    "16..512 pow2, then x512": tuple([16 << i for i in range(6)] + list(range(1024, 65537, 512))),
    "multiples of 256": tuple(range(256, 65537, 256)),
    "powers of two": tuple(16 << i for i in range(13)),
}


def main():
    rng = np.random.default_rng(0)
    mixes = {"uniform 1..2048": rng.integers(1, 2049, 100000),
             "uniform 1..8192": rng.integers(1, 8193, 100000),
             "lognormal, median 300": np.clip(rng.lognormal(np.log(300), 1.0, 100000).astype(int), 1, 32768)}
    print(f"{'mix':<22} {'ladder':<40} {'buckets':>7} {'padded':>8}")
    for mix, lens in mixes.items():
        for name, ladder in LADDERS.items():
            lad = np.asarray(ladder)
            b = lad[np.searchsorted(lad, lens)]
            print(f"{mix:<22} {name:<40} {len(set(b.tolist())):7d} {b.sum() / lens.sum() - 1:8.1%}")


if __name__ == "__main__":
    main()
