"""Would entropy-coding log8-rel's fixed-width codes reach issue 26's <= 21% of FP32?

    python bench/experiments/entropy_log8rel.py [--out bench/experiments/results/entropy_log8rel.md]

The state is bench/cert_speed.py's trained ByteTransformer (867,328 Adam coordinates, 60
steps of the real torch.optim.Adam), encoded with log8-rel (default tau/C) as `jaxguard
compress` does.  For every tensor: the order-0 empirical entropy of its m codes, v codes
and (m, v) pairs (the floor of a per-tensor static entropy coder, models not counted),
then the payload those floors give with the block parameters and escapes as stored.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def entropy_bits(x):
    c = np.unique(np.asarray(x).astype(np.int64), return_counts=True)[1]
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "experiments", "results", "entropy_log8rel.md"))
    a = ap.parse_args(argv)
    import cert_speed
    import torch_compat
    from jaxguard import writer
    from jaxguard.core.config import GuardSpec
    ck = cert_speed._tiled(cert_speed._base(), 1)
    _, records = torch_compat.state.state_records(ck["optimizer"], ck["model"], spec=GuardSpec(codec="log8-rel"))
    n = hm = hv = hj = params = esc = payload = 0
    for e in writer.encode(records, {}):
        enc = getattr(e, "encoded", None)
        if enc is None or "m_codes" not in enc.arrays:
            continue
        arr, k = enc.arrays, enc.arrays["m_codes"].size
        n += k
        hm += entropy_bits(arr["m_codes"]) * k
        hv += entropy_bits(arr["v_codes"]) * k
        hj += entropy_bits(arr["m_codes"].astype(np.int64) * 256 + arr["v_codes"]) * k
        params += arr["m_params"].nbytes + arr["v_params"].nbytes
        esc += arr["escape_index"].size
        payload += enc.stats["payload_bytes"]
    fp32, esc_bytes = 8 * n, esc * 12     # an escape stores its index and both moments
    sep = (hm + hv) / 8 + params + esc_bytes
    joint = hj / 8 + params + esc_bytes
    lines = ["# Entropy-coded log8-rel: a floor (issue 26)", "",
             f"`python bench/experiments/entropy_log8rel.py`: {n:,} coordinates of a trained ByteTransformer "
             "(bench/cert_speed.py's state), log8-rel, default tau/C.", "",
             "| | bits per coordinate | payload, % of FP32 |", "|---|---:|---:|",
             f"| log8-rel as stored (8 + 8 bits) | 16.00 | {100 * payload / fp32:.2f}% |",
             f"| m, v codes at their order-0 entropy, separately | {(hm + hv) / n:.2f} | {100 * sep / fp32:.2f}% |",
             f"| (m, v) pairs at their joint order-0 entropy | {hj / n:.2f} | {100 * joint / fp32:.2f}% |", "",
             f"Block parameters {100 * params / fp32:.2f}% of FP32, escapes {esc:,} ({100 * esc / n:.3f}%). "
             f"H(m) = {hm / n:.2f}, H(v) = {hv / n:.2f} bits: the log grid spreads the codes nearly evenly over "
             "their 256 levels, so an entropy coder over log8-rel's codes gains 1.4-2.2 bits a coordinate, and the "
             "floor stays above issue 26's 21% (logrel-ans gets below it by choosing narrower widths and moving "
             "codes within the guard's slack, which is what costs its encode time)."]
    with open(a.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
