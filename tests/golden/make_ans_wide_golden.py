"""Writes tests/golden/containers/logrel-ans-wide.jaxguard ONCE (jaxguard at the commit that
added the 9..12-bit block widths, issue 17 H17-wide) and adds its decoded bits to
expected.npz (the other keys are kept as they are).  Two moments entries of two-population
blocks (half the coordinates with sqrt(v) near 2**-7, half near 2**-22: v spans ~30
binades, so the blocks certify at 9..12 bits; |m|/sqrt(v) up to 12 in layer/w, so m
needs more than 8 bits too): ``layer/w`` (24 blocks and a partial one, rANS-coded:
sections ``mv_rans``, ``m_low``, ``v_low``) and ``layer/small`` (one block, stored in
logrel-aw's packed form with 9..12-bit fields).  Every later version of
jaxguard must read this file and decode it to the same bits.

    PYTHONPATH=$PWD python tests/golden/make_ans_wide_golden.py
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxguard.core.guard as G  # noqa: E402
import jaxguard.format.container as C  # noqa: E402
import jaxguard.format.packed as P  # noqa: E402
import jaxguard.format.reader as R  # noqa: E402
from make_container_golden import HERE  # noqa: E402

CODEC = "logrel-ans"
NAME = "logrel-ans-wide"


def two_populations(n, seed, ratio=0.9):
    """Moments of a block mixing two populations whose v differ by ~30 binades, |m|/sqrt(v)
    in 0.05..ratio."""
    rng = np.random.default_rng(seed)
    big = rng.random(n) < 0.5
    sv = np.where(big, 2.0**-7, 2.0**-22) * rng.uniform(0.5, 2.0, n)
    v = (sv * sv).astype(np.float32)
    m = (rng.choice([-1.0, 1.0], n) * rng.uniform(0.05, ratio, n) * sv).astype(np.float32)
    return m, v, rng.normal(0, 0.05, n).astype(np.float32)


def main():
    cfg = G.GuardConfig(lr=1e-3, step=100, codec=CODEC)
    mb, vb, pb = two_populations(256 * 24 + 77, 20261218, ratio=12.0)
    ms, vs, ps = two_populations(256, 20261219)
    eb, es = G.encode(mb, vb, pb, cfg), G.encode(ms, vs, ps, cfg)
    for e in (eb, es):
        assert (np.maximum(*P.split_widths(e.arrays["widths"])) > 8).any()
    entries = [C.Moments("layer/w", eb, {"config": cfg.to_json()}), C.Raw("layer/w.param", pb, None),
               C.Moments("layer/small", es, {"config": cfg.to_json()}), C.Raw("layer/small.param", ps, None),
               C.Raw("step", np.asarray(100, np.int64), None)]
    data = C.build(entries, {"source": "golden", "codec": CODEC})
    header, payload = R.parse(data)
    forms = {e["name"]: sorted(k for k in e["sections"] if k in ("mv_rans", "m_low", "v_low", "m_codes"))
             for e in header["entries"] if e["kind"] == "moments"}
    assert forms == {"layer/w": ["m_low", "mv_rans", "v_low"], "layer/small": ["m_codes"]}, forms
    path = os.path.join(HERE, f"{NAME}.jaxguard")
    C.atomic_write(path, data)
    info = R.verify_file(path)
    tables = R.read_tables(header, payload)
    expected = dict(np.load(os.path.join(HERE, "expected.npz")))
    for e in header["entries"]:
        if e["kind"] != "moments":
            continue
        mt, vt = R.read_moments(e, payload, tables)
        key = f"{NAME}:{e['name']}"
        expected[f"{key}/m_bits"] = np.asarray(mt, np.float32).view(np.uint32)
        expected[f"{key}/v_bits"] = np.asarray(vt, np.float32).view(np.uint32)
    expected[f"{NAME}/decoded_sha256"] = np.array(info["decoded_sha256"])
    np.savez_compressed(os.path.join(HERE, "expected.npz"), **expected)
    print(json.dumps({"decoded_sha256": info["decoded_sha256"], "bytes": len(data), "forms": forms,
                      "widths": {"layer/w": sorted({hex(int(x)) for x in eb.arrays["widths"]}),
                                 "layer/small": [hex(int(x)) for x in es.arrays["widths"]]},
                      "escapes": [eb.stats["escapes"], es.stats["escapes"]]}))


if __name__ == "__main__":
    main()
