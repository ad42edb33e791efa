"""Writes tests/golden/codes_v1.npz ONCE (python tests/golden/make_codes_golden.py).
Every later version of jaxguard must encode these inputs to the same codes and decode
them to the same bits, in JAX, numpy (the reader) and torch."""
import os

import numpy as np

import jaxguard.core.guard as G


def inputs():
    rng = np.random.default_rng(20261129)
    n = 256 * 6 + 77
    v = rng.lognormal(-14, 2, n).astype(np.float32)
    m = (rng.normal(0, 1, n) * np.sqrt(v) * 0.3).astype(np.float32)
    v[256:512] = 0.0                                   # all-zero block
    m[256:512] = 0.0
    v[512:768] = np.float32(3.5e-7)                    # constant block
    v[768:1024] = np.float32(10.0) ** rng.uniform(-30, 0, 256).astype(np.float32)  # 30 decades
    v[1024:1030] = [1e-40, 3e38, 2e-38, 1e-45, 0.0, 1.0]
    m[1024:1030] = [-1e-40, 3e38, -3e38, 0.0, -0.0, 1e-30]
    v[1030::97] = 0.0
    return m, v, rng.normal(0, 0.05, n).astype(np.float32)


def main():
    m, v, p = inputs()
    out = {"m": m, "v": v, "p": p}
    for codec in ("log8", "log8-rel", "bf16", "block8"):
        e = G.encode(m, v, p, G.GuardConfig(lr=1e-3, step=100, codec=codec))
        mt, vt = G.decode_arrays(e.arrays, codec, m.size)
        for k in ("m_codes", "v_codes", "m_params", "v_params"):
            out[f"{codec}/{k}"] = np.asarray(e.arrays[k])
        out[f"{codec}/m_decoded_bits"] = np.asarray(mt).view(np.uint32)
        out[f"{codec}/v_decoded_bits"] = np.asarray(vt).view(np.uint32)
    np.savez_compressed(os.path.join(os.path.dirname(__file__), "codes_v1.npz"), **out)


if __name__ == "__main__":
    main()
