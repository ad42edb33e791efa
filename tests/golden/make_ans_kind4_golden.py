"""Writes tests/golden/containers/logrel-ans-kind4.jaxguard and its expected values
logrel-ans-kind4.expected.npz ONCE (jaxguard at the commit that added rANS kind 4 and the
rate pass, issue 17).  Moments entries: ``layer/wide`` (make_ans_wide_golden.py's
two-population tensor, 24 blocks and a partial one whose fields are 9..12 bits wide:
``mv_rans`` of kind byte 0x14, whole fields, no ``m_low`` / ``v_low``), ``layer/w`` (the
inputs of make_container_golden.py, NaN/Inf/subnormal/negative values included: kind
0x13, every block <= 8 bits) and ``layer/tiny`` (16 coordinates, packed).  The codes are
the rate pass's (jaxguard.core.rate), not the nearest ones.  Every later version of
jaxguard must read this file and decode it to the same bits (tests/format/test_golden_containers.py).

    PYTHONPATH=$PWD python tests/golden/make_ans_kind4_golden.py      # refuses to overwrite
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxguard.core.guard as G  # noqa: E402
import jaxguard.format.container as C  # noqa: E402
import jaxguard.format.reader as R  # noqa: E402
from make_ans_wide_golden import two_populations  # noqa: E402
from make_container_golden import HERE, inputs  # noqa: E402

CODEC = "logrel-ans"
NAME = "logrel-ans-kind4"


def main():
    path = os.path.join(HERE, f"{NAME}.jaxguard")
    if os.path.exists(path):
        sys.exit(f"{path} exists: golden containers are written once; add a new one instead")
    cfg = G.GuardConfig(lr=1e-3, step=100, codec=CODEC)
    tensors = {"layer/wide": two_populations(256 * 24 + 77, 20261218, ratio=12.0), "layer/w": inputs(),
               "layer/tiny": tuple(x[:16] for x in inputs())}
    entries = []
    for name, (m, v, p) in tensors.items():
        entries += [C.Moments(name, G.encode(m, v, p, cfg, keep_decoded=True), {"config": cfg.to_json()}),
                    C.Raw(f"{name}.param", p, None)]
    entries.append(C.Raw("step", np.asarray(100, np.int64), None))
    data = C.build(entries, {"source": "golden", "codec": CODEC})
    header, payload = R.parse(data)
    forms = {e["name"]: (int(payload[e["sections"]["mv_rans"][0]]) if "mv_rans" in e["sections"] else None,
                         sorted(set(e["sections"]) & {"m_low", "v_low"}))
             for e in header["entries"] if e["kind"] == "moments"}
    assert forms == {"layer/wide": (0x14, []), "layer/w": (0x13, []), "layer/tiny": (None, [])}, forms
    C.atomic_write(path, data)
    info = R.verify_file(path)
    tables = R.read_tables(header, payload)
    expected = {"decoded_sha256": np.array(info["decoded_sha256"])}
    for e in header["entries"]:
        if e["kind"] == "moments":
            mt, vt = R.read_moments(e, payload, tables)
            expected[f"{e['name']}/m_bits"] = np.asarray(mt, np.float32).view(np.uint32)
            expected[f"{e['name']}/v_bits"] = np.asarray(vt, np.float32).view(np.uint32)
    np.savez_compressed(os.path.join(HERE, f"{NAME}.expected.npz"), **expected)
    print(json.dumps({"decoded_sha256": info["decoded_sha256"], "bytes": len(data), "forms": forms}))


if __name__ == "__main__":
    main()
