"""Writes tests/golden/containers/logrel-ans.jaxguard ONCE (jaxguard at the commit that added
the codec, issue 17) and adds its decoded bits to expected.npz (the other codecs' keys are
kept as they are).  Two moments entries: ``layer/w`` (the inputs of make_container_golden.py
tiled to 40 blocks plus a partial one, so its code streams are rANS-coded: section
``mv_rans``; the NaN/Inf/subnormal/negative values of those inputs in every tile) and
``layer/small`` (the first block of make_container_golden's inputs, stored in logrel-aw's
packed form, which is smaller there).  Every later version of jaxguard must read
this file and decode it to the same bits.

    PYTHONPATH=$PWD python tests/golden/make_ans_golden.py
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxguard.core.guard as G  # noqa: E402
import jaxguard.format.container as C  # noqa: E402
import jaxguard.format.reader as R  # noqa: E402
from make_container_golden import HERE, inputs  # noqa: E402

CODEC = "logrel-ans"


def big_inputs():
    m, v, p = inputs()
    k = 8
    rng = np.random.default_rng(20261217)
    n = 256 * 40 + 99
    with np.errstate(over="ignore"):    # 3e38 * 2 -> inf: one more special value
        vs = np.concatenate([v * np.float32(rng.uniform(0.5, 2.0)) for _ in range(k)])[:n].astype(np.float32)
    ms = np.concatenate([m] * k)[:n].astype(np.float32)
    ps = rng.normal(0, 0.05, n).astype(np.float32)
    return ms, vs, ps


def main():
    cfg = G.GuardConfig(lr=1e-3, step=100, codec=CODEC)
    mb, vb, pb = big_inputs()
    ms, vs, ps = (x[:256] for x in inputs())
    eb, es = G.encode(mb, vb, pb, cfg), G.encode(ms, vs, ps, cfg)
    entries = [C.Moments("layer/w", eb, {"config": cfg.to_json()}), C.Raw("layer/w.param", pb, None),
               C.Moments("layer/small", es, {"config": cfg.to_json()}), C.Raw("layer/small.param", ps, None),
               C.Raw("step", np.asarray(100, np.int64), None)]
    data = C.build(entries, {"source": "golden", "codec": CODEC})
    header, payload = R.parse(data)
    forms = {e["name"]: ("mv_rans" in e["sections"]) for e in header["entries"] if e["kind"] == "moments"}
    assert forms == {"layer/w": True, "layer/small": False}, forms
    path = os.path.join(HERE, f"{CODEC}.jaxguard")
    C.atomic_write(path, data)
    info = R.verify_file(path)
    tables = R.read_tables(header, payload)
    expected = dict(np.load(os.path.join(HERE, "expected.npz")))
    for e in header["entries"]:
        if e["kind"] != "moments":
            continue
        mt, vt = R.read_moments(e, payload, tables)
        key = CODEC if e["name"] == "layer/w" else f"{CODEC}:{e['name']}"
        expected[f"{key}/m_bits"] = np.asarray(mt, np.float32).view(np.uint32)
        expected[f"{key}/v_bits"] = np.asarray(vt, np.float32).view(np.uint32)
    expected[f"{CODEC}/decoded_sha256"] = np.array(info["decoded_sha256"])
    np.savez_compressed(os.path.join(HERE, "expected.npz"), **expected)
    print(json.dumps({"decoded_sha256": info["decoded_sha256"], "bytes": len(data), "forms": forms}))


if __name__ == "__main__":
    main()
