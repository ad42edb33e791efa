"""Writes tests/golden/rans_v2.npz ONCE (jaxguard.format.rans buffers with compact models,
layout kind 3, issue 17; rans_v1.npz keeps the kind 1 and 2 buffers).

    PYTHONPATH=$PWD python tests/golden/make_rans_v2.py      # refuses to overwrite

Every later version must decode these buffers to these symbols and, given the stored
models, write the same bytes (tests/format/test_rans.py); do not regenerate.
"""
import sys
from pathlib import Path

import numpy as np

from jaxguard.format import rans

OUT = Path(__file__).with_name("rans_v2.npz")


def cases():
    rng = np.random.default_rng(20261217)
    out = []
    for name, n, S in (("cnn-like", 1000, 2), ("mixed-widths", 256 * 9 + 17, 2), ("one-symbol", 300, 1),
                       ("all-symbols", 256 * 2, 2), ("width0", 700, 1), ("gappy", 256 * 3, 1), ("tails", 600, 2)):
        nb = max(1, -(-n // 256))
        if name == "mixed-widths":
            bits = np.stack([np.arange(nb) % 9, (np.arange(nb) + 4) % 9])[:S]
        elif name == "width0":
            bits = np.zeros((S, nb), np.int64)
        elif name in ("all-symbols", "gappy"):
            bits = np.full((S, nb), 8)
        else:
            bits = rng.integers(5, 9, size=(S, nb))
        half = (1 << bits)[:, :, None] // 2
        sym = np.clip(np.round(rng.laplace(0, 5, size=(S, nb, 256))) + half, 0, 2 * half - 1)
        if name == "one-symbol":
            sym = np.full_like(sym, 3)
        elif name == "all-symbols":
            sym = np.broadcast_to(np.arange(256), sym.shape).copy()
        elif name == "gappy":
            sym = (sym // 4) * 4
        coded = np.arange(256)[None] < np.minimum(256, n - 256 * np.arange(nb))[:, None]
        sym = np.where(coded[None], sym.astype(np.int64) % (1 << bits)[:, :, None], 0).astype(np.uint8)
        tails = rng.integers(0, 1 << 16, size=nb) if name == "tails" else None
        out.append((name, n, sym, bits.astype(np.uint8), tails,
                    rans.encode_streams(sym, bits, n, lane_tails=tails, compact_models=True)))
    return out


def main():
    if OUT.exists():
        sys.exit(f"{OUT} exists: golden vectors are written once; add a new version instead")
    cs = cases()
    arrays = {"names": np.array([c[0] for c in cs])}
    for k, (name, n, sym, bits, tails, buf) in enumerate(cs):
        np.testing.assert_array_equal(rans.decode_streams(buf, bits, n, lane_tails=tails is not None)[0]
                                      if tails is not None else rans.decode_streams(buf, bits, n), sym)
        arrays.update({f"n_{k}": np.array(n), f"symbols_{k}": sym, f"bits_{k}": bits,
                       f"buf_{k}": np.frombuffer(buf, np.uint8),
                       f"tails_{k}": np.asarray(tails if tails is not None else [], np.uint16)})
        print(name, n, len(buf), "bytes")
    np.savez_compressed(OUT, **arrays)


if __name__ == "__main__":
    main()
