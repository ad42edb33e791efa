"""Writes tests/golden/containers/log8-rel-zstd.jaxguard, its expected values
log8-rel-zstd.expected.npz and the stream vectors tests/golden/zstd_v1.npz ONCE (jaxguard at
the commit that added codec log8-rel-zstd, issue 57; zstandard 0.25).  Moments entries:

* ``layer/w``: the inputs of make_container_golden.py (NaN/Inf/subnormal/negative values,
  exact zeros), every block 8 bits;
* ``layer/wide``: make_ans_wide_golden.py's two-population tensor, whose blocks escape at
  8 bits and are proposed again at 10-bit v: ``widths`` and ``v_high``;
* ``layer/big``: 2**20 + 300 coordinates, mostly exact zeros: code streams of two frames;
* ``layer/tiny``: 16 coordinates, every stream stored as is;
* ``layer/explicit``: layer/w's codes with one block's ``wlo`` one ulp off its square root
  (written without the guard, ``"certify": false``): the 20-byte parameter form.

The zstd frames' bytes are this zstandard's; every later reader must decode this file to the
same bits (tests/format/test_golden_containers.py), whatever zstd a later writer uses.

    PYTHONPATH=$PWD python tests/golden/make_zstd_golden.py      # refuses to overwrite
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxguard.core.guard as G  # noqa: E402
import jaxguard.format.container as C  # noqa: E402
import jaxguard.format.entropy as Z  # noqa: E402
import jaxguard.format.reader as R  # noqa: E402
from make_ans_wide_golden import two_populations  # noqa: E402
from make_container_golden import HERE, inputs  # noqa: E402

CODEC = "log8-rel-zstd"
STREAMS = os.path.join(os.path.dirname(HERE), "zstd_v1.npz")


def big():
    n = (1 << 20) + 300
    rng = np.random.default_rng(20261207)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    at = rng.choice(n, 4000, replace=False)
    v[at] = np.exp2(rng.uniform(-30, -20, at.size)).astype(np.float32)
    m[at] = (np.sqrt(v[at]) * rng.uniform(-1, 1, at.size)).astype(np.float32)
    return m, v, (rng.standard_normal(n) * 0.05).astype(np.float32)


def main():
    path = os.path.join(HERE, f"{CODEC}.jaxguard")
    if os.path.exists(path) or os.path.exists(STREAMS):
        sys.exit(f"{path} or {STREAMS} exists: golden files are written once; add a new one instead")
    cfg = G.GuardConfig(lr=1e-3, step=100, codec=CODEC)
    tensors = {"layer/w": inputs(), "layer/wide": two_populations(256 * 24 + 77, 20261218, ratio=12.0),
               "layer/big": big(), "layer/tiny": tuple(x[:16] for x in inputs())}
    entries = []
    for name, (m, v, p) in tensors.items():
        entries.append(C.Moments(name, G.encode(m, v, p, cfg, keep_decoded=True), {"config": cfg.to_json()}))
    w = G.encode(*inputs(), cfg)
    arrays = dict(w.arrays)
    vp = np.array(arrays["v_params"])
    vp[2, 2] = np.nextafter(vp[2, 2], np.float32(1))
    arrays["v_params"] = vp
    entries.append(C.Moments("layer/explicit", G.Encoded(arrays, CODEC, w.shape, dict(w.stats)),
                             {"config": {**cfg.to_json(), "certify": False}}))
    entries.append(C.Raw("step", np.asarray(100, np.int64), None))
    data = C.build(entries, {"source": "golden", "codec": CODEC})
    header, payload = R.parse(data)
    forms = {e["name"]: sorted(e["sections"]) for e in header["entries"] if e["kind"] == "moments"}
    assert "v_high" in forms["layer/wide"] and "widths" in forms["layer/wide"], forms
    big_m = header["entries"][[e["name"] for e in header["entries"]].index("layer/big")]["sections"]["m_codes"]
    assert len(Z.stream_frames(payload[big_m[0]:big_m[1]], "big")[1]) == 2
    C.atomic_write(path, data)
    info = R.verify_file(path)
    expected = {"decoded_sha256": np.array(info["decoded_sha256"])}
    for e in header["entries"]:
        if e["kind"] == "moments":
            mt, vt = R.read_moments(e, payload, {})
            expected[f"{e['name']}/m_bits"] = np.asarray(mt, np.float32).view(np.uint32)
            expected[f"{e['name']}/v_bits"] = np.asarray(vt, np.float32).view(np.uint32)
    np.savez_compressed(os.path.join(HERE, f"{CODEC}.expected.npz"), **expected)
    # stream vectors: (stream bytes, decoded bytes) of each kind of stream
    rng = np.random.default_rng(7)
    cases = {"empty": np.zeros(0, np.uint8), "as_is": rng.integers(0, 256, 300).astype(np.uint8),
             "one_frame": rng.integers(0, 30, 5000).astype(np.uint8),
             "two_frames": np.repeat(rng.integers(0, 20, (1 << 20) // 64 + 5).astype(np.uint8), 64)[:(1 << 20) + 300],
             "planes": Z.to_planes(np.float32([1e-9, 2.5e-9, 1.0, 1.01, 0.003, 7.0]))}
    vectors = {}
    for k, d in cases.items():
        vectors[f"{k}/stream"] = Z.encode_stream(d)
        vectors[f"{k}/decoded"] = d
    np.savez_compressed(STREAMS, **vectors)
    print(json.dumps({"decoded_sha256": info["decoded_sha256"], "bytes": len(data), "forms": forms}, indent=1))


if __name__ == "__main__":
    main()
