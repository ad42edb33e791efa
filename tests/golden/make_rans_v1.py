"""Writes tests/golden/rans_v1.npz ONCE (jaxguard.format.rans buffers, layout kind 1 and 2).

    PYTHONPATH=$PWD python tests/golden/make_rans_v1.py      # refuses to overwrite

Every later version must decode these buffers to these symbols (tests/format/test_rans.py); do
not regenerate: add rans_v2.npz for a new layout.
"""
import sys
from pathlib import Path

import numpy as np

from jaxguard.format import rans

OUT = Path(__file__).with_name("rans_v1.npz")


def cases():
    rng = np.random.default_rng(20261201)
    out = []
    # (name, n, streams, widths chooser, symbol maker)
    for name, n, S in (("one-symbol", 1, 1), ("partial", 300, 2), ("mixed-widths", 256 * 9 + 17, 2),
                       ("skewed-8bit", 256 * 4, 1), ("empty", 0, 2), ("width0", 700, 1)):
        nb = max(1, -(-n // 256))
        if name == "mixed-widths":
            bits = np.stack([np.arange(nb) % 9, (np.arange(nb) + 4) % 9])[:S]
        elif name == "width0":
            bits = np.zeros((S, nb), np.int64)
        elif name == "skewed-8bit":
            bits = np.full((S, nb), 8)
        else:
            bits = rng.integers(4, 9, size=(S, nb))
        sym = (rng.geometric(0.15, size=(S, nb, 256)) - 1) % (1 << bits)[:, :, None]
        coded = np.arange(256)[None] < np.minimum(256, n - 256 * np.arange(nb))[:, None]
        sym = np.where(coded[None], sym, 0).astype(np.uint8)
        out.append((name, n, sym, bits.astype(np.uint8), rans.encode_streams(sym, bits, n)))
    # shared (external) models: fitted on one set, used for another of the same widths
    n, nb = 256 * 3, 3
    bits = np.array([[6, 7, 6], [5, 5, 8]])
    a = ((rng.geometric(0.1, size=(2, nb, 256)) - 1) % (1 << bits)[:, :, None]).astype(np.uint8)
    cover = np.broadcast_to(np.arange(256), a.shape) % (1 << bits)[:, :, None]    # every symbol present
    models = rans.fit_models(cover, bits, n)
    out.append(("external", n, a, bits.astype(np.uint8), rans.encode_streams(a, bits, n, models, inline_models=False)))
    return out, rans.encode_models(models)


def main():
    if OUT.exists():
        sys.exit(f"{OUT} exists: golden vectors are written once; add a new version instead")
    cs, ext = cases()
    arrays = {"names": np.array([c[0] for c in cs]), "external_models": np.frombuffer(ext, np.uint8)}
    for k, (name, n, sym, bits, buf) in enumerate(cs):
        arrays[f"n_{k}"] = np.array(n, np.int64)
        arrays[f"symbols_{k}"] = sym
        arrays[f"bits_{k}"] = bits
        arrays[f"buf_{k}"] = np.frombuffer(buf, np.uint8)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT}: {len(cs)} cases, {sum(len(c[4]) for c in cs)} encoded bytes")


if __name__ == "__main__":
    main()
