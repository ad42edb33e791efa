"""Writes tests/golden/codes_aw_v1.npz ONCE (python tests/golden/make_aw_golden.py): the
logrel-aw codec on the inputs of make_codes_golden.py.  Every later version of jaxguard
must encode these inputs to the same codes, pack them to the same bytes, and decode them
to the same bits in JAX, numpy (the reader) and torch."""
import os
import sys

import numpy as np

import jaxguard.core.guard as G
from jaxguard.format import packed

sys.path.insert(0, os.path.dirname(__file__))
from make_codes_golden import inputs  # noqa: E402


def main():
    m, v, p = inputs()
    e = G.encode(m, v, p, G.GuardConfig(lr=1e-3, step=100, codec=packed.CODEC))
    a = e.arrays
    out = {"m": m, "v": v, "p": p}
    for k in ("m_codes", "v_codes", "m_params", "v_params", "widths", "escape_index"):
        out[k] = np.asarray(a[k])
    bm, bv = packed.split_widths(a["widths"])
    nb = bm.size
    qm = np.zeros(nb * 256, np.int64)
    qm[:m.size] = a["m_codes"]
    qv = np.zeros(nb * 256, np.int64)
    qv[:m.size] = a["v_codes"]
    out["m_stream"] = packed.pack(qm + np.repeat((1 << (bm - 1)) - 1, 256), bm, m.size)
    out["v_stream"] = packed.pack(qv, bv, m.size)
    out["escape_varints"] = packed.varint_encode(a["escape_index"])
    mt, vt = G.decode_arrays(a, packed.CODEC, m.size)
    out["m_decoded_bits"] = np.asarray(mt).view(np.uint32)
    out["v_decoded_bits"] = np.asarray(vt).view(np.uint32)
    np.savez_compressed(os.path.join(os.path.dirname(__file__), "codes_aw_v1.npz"), **out)


if __name__ == "__main__":
    main()
