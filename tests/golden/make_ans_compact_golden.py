"""Writes tests/golden/containers/logrel-ans-compact.jaxguard and its expected values
logrel-ans-compact.expected.npz ONCE (jaxguard at the commit that added compact rANS
models, issue 17: kind byte 0x13).  Moments entries: ``layer/w``, the inputs of
make_container_golden.py (1,357 coordinates, NaN/Inf/subnormal/negative values included:
the CNN's tensor sizes, where 4-bit-level models would lose to the packed form), rANS-coded
with compact models; ``layer/big`` (make_ans_golden.py's 40-block tensor) rANS-coded with
compact models; ``layer/small`` (the first block) rANS-coded too (with 4-bit-level models
it was packed: tests/golden/containers/logrel-ans.jaxguard); ``layer/tiny`` (16
coordinates, a CNN bias) in the packed form.  Every later version
of jaxguard must read this file and decode it to the same bits (tests/format/test_golden_containers.py).

    PYTHONPATH=$PWD python tests/golden/make_ans_compact_golden.py      # refuses to overwrite
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxguard.core.guard as G  # noqa: E402
import jaxguard.format.container as C  # noqa: E402
import jaxguard.format.reader as R  # noqa: E402
from make_ans_golden import big_inputs  # noqa: E402
from make_container_golden import HERE, inputs  # noqa: E402

CODEC = "logrel-ans"
NAME = "logrel-ans-compact"


def main():
    path = os.path.join(HERE, f"{NAME}.jaxguard")
    if os.path.exists(path):
        sys.exit(f"{path} exists: golden containers are written once; add a new one instead")
    cfg = G.GuardConfig(lr=1e-3, step=100, codec=CODEC)
    tensors = {"layer/w": inputs(), "layer/big": big_inputs(), "layer/small": tuple(x[:256] for x in inputs()),
               "layer/tiny": tuple(x[:16] for x in inputs())}
    entries = []
    for name, (m, v, p) in tensors.items():
        entries += [C.Moments(name, G.encode(m, v, p, cfg), {"config": cfg.to_json()}),
                    C.Raw(f"{name}.param", p, None)]
    entries.append(C.Raw("step", np.asarray(100, np.int64), None))
    data = C.build(entries, {"source": "golden", "codec": CODEC})
    header, payload = R.parse(data)
    kinds = {e["name"]: (int(payload[e["sections"]["mv_rans"][0]]) if "mv_rans" in e["sections"] else None)
             for e in header["entries"] if e["kind"] == "moments"}
    assert kinds == {"layer/w": 0x13, "layer/big": 0x13, "layer/small": 0x13, "layer/tiny": None}, kinds
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
    print(json.dumps({"decoded_sha256": info["decoded_sha256"], "bytes": len(data), "kinds": kinds}))


if __name__ == "__main__":
    main()
