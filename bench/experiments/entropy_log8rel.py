"""Would entropy-coding log8-rel's fixed-width codes reach issue 26's <= 21% of FP32?

    python bench/experiments/entropy_log8rel.py [--out bench/experiments/results/entropy_log8rel.md]
    python bench/experiments/entropy_log8rel.py --container GPT2.jg --out bench/experiments/results/entropy_log8rel_gpt2.md

The state is bench/cert_speed.py's trained ByteTransformer (867,328 Adam coordinates, 60
steps of the real torch.optim.Adam), encoded with log8-rel (default tau/C) as `jaxguard
compress` does; or, with ``--container``, the codes of a log8-rel container `jaxguard
compress` wrote (e.g. of bench/codec_speed.py's GPT-2 checkpoint).  For every tensor: the order-0 empirical entropy of its m codes, v codes
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
    ap.add_argument("--container", help="read the codes of this log8-rel container instead of encoding the "
                                        "ByteTransformer")
    a = ap.parse_args(argv)
    n = hm = hv = hj = params = esc = payload = 0
    for arr, entry_payload in (_container_codes(a.container) if a.container else _encoded_codes()):
        k = arr["m_codes"].size
        payload += entry_payload
        n += k
        hm += entropy_bits(arr["m_codes"]) * k
        hv += entropy_bits(arr["v_codes"]) * k
        hj += entropy_bits(arr["m_codes"].astype(np.int64) * 256 + arr["v_codes"]) * k
        params += arr["m_params"].nbytes + arr["v_params"].nbytes
        esc += arr["escape_index"].size
    fp32, esc_bytes = 8 * n, esc * 12     # an escape stores its index and both moments
    sep = (hm + hv) / 8 + params + esc_bytes
    joint = hj / 8 + params + esc_bytes
    what = (f"`python bench/experiments/entropy_log8rel.py --container {os.path.basename(a.container)}`: {n:,} "
            "coordinates of a log8-rel container written by `jaxguard compress`" if a.container else
            f"`python bench/experiments/entropy_log8rel.py`: {n:,} coordinates of a trained ByteTransformer "
            "(bench/cert_speed.py's state), log8-rel")
    lines = ["# Entropy-coded log8-rel: a floor (issue 26)", "",
             f"{what}, default tau/C.", "",
             "| | bits per coordinate | payload, % of FP32 |", "|---|---:|---:|",
             f"| log8-rel as stored (8 + 8 bits) | 16.00 | {100 * payload / fp32:.2f}% |",
             f"| m, v codes at their order-0 entropy, separately | {(hm + hv) / n:.2f} | {100 * sep / fp32:.2f}% |",
             f"| (m, v) pairs at their joint order-0 entropy | {hj / n:.2f} | {100 * joint / fp32:.2f}% |", "",
             f"Block parameters {100 * params / fp32:.2f}% of FP32, escapes {esc:,} ({100 * esc / n:.3f}%). "
             f"H(m) = {hm / n:.2f}, H(v) = {hv / n:.2f} bits: the log grid spreads the codes nearly evenly over "
             f"their 256 levels, so an entropy coder over log8-rel's codes gains {16 - (hm + hv) / n:.1f}-"
             f"{16 - hj / n:.1f} bits a coordinate, and the "
             "floor stays above issue 26's 21% (logrel-ans gets below it by choosing narrower widths and moving "
             "codes within the guard's slack, which is what costs its encode time)."]
    with open(a.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _encoded_codes():
    """(arrays, payload bytes) of each coded entry of the ByteTransformer's log8-rel encode."""
    import cert_speed
    import torch_compat
    from jaxguard import writer
    from jaxguard.core.config import GuardSpec
    ck = cert_speed._tiled(cert_speed._base(), 1)
    _, records = torch_compat.state.state_records(ck["optimizer"], ck["model"], spec=GuardSpec(codec="log8-rel"))
    for e in writer.container_entries(records, {}):
        enc = getattr(e, "encoded", None)
        if enc is not None and "m_codes" in enc.arrays:
            yield enc.arrays, enc.stats["payload_bytes"]


def _container_codes(path):
    """(arrays, payload bytes) of each log8-rel moments entry of the container at `path`."""
    from jaxguard.format import container, reader
    header, payload, tables = container.read(path, verify_decoded=False)
    for e in header["entries"]:
        if e.get("kind") != "moments":
            continue
        if e["codec"] != "log8-rel":
            raise SystemExit(f"{path}: entry {e['name']} is {e['codec']}; pass a log8-rel container")
        yield reader.read_codes(e, payload, tables), e["stats"]["payload_bytes"]


if __name__ == "__main__":
    main()
