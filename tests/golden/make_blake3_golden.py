"""Writes tests/golden/containers/blake3-*.jaxguard and blake3.expected.npz ONCE (jaxguard at
the commit that made BLAKE3 the integrity hash of new files, issue 58; blake3 1.0.11): one
container per codec (log8-rel, log8-rel-zstd, logrel-ans) from the inputs of
make_container_golden.py (NaN/Inf/subnormal/negative values, exact zeros), prefix flags 1,
header ``"hash": "blake3"``.  Every later reader must verify these files (trailer, payload
and decoded BLAKE3) and decode them to the same bits (tests/format/test_integrity_hash.py).
Beside each digest the expected file keeps the SHA-256 of the same payload and decoded
moments: the bytes are the ones a SHA-256 file of the same entries holds.

    PYTHONPATH=$PWD python tests/golden/make_blake3_golden.py      # refuses to overwrite
"""
import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxguard.format.container as C  # noqa: E402
import jaxguard.format.reader as R  # noqa: E402
from make_container_golden import HERE, golden_entries, inputs  # noqa: E402

CODECS = ("log8-rel", "log8-rel-zstd", "logrel-ans")
EXPECTED = os.path.join(HERE, "blake3.expected.npz")


def main():
    if os.path.exists(EXPECTED):
        sys.exit(f"{EXPECTED} exists: golden vectors are written once")
    m, v, p = inputs()
    expected = {}
    for codec in CODECS:
        data = C.build(golden_entries(codec, m, v, p), {"source": "golden", "codec": codec}, integrity_hash="blake3")
        path = os.path.join(HERE, f"blake3-{codec}.jaxguard")
        C.atomic_write(path, data)
        info = R.verify_file(path)
        assert info["hash"] == "blake3"
        header, payload = R.parse(data)
        tables = R.read_tables(header, payload)
        entry = next(e for e in header["entries"] if e["name"] == "layer/w")
        mt, vt = R.read_moments(entry, payload, tables)
        expected[f"{codec}/m_bits"] = np.asarray(mt, np.float32).view(np.uint32)
        expected[f"{codec}/v_bits"] = np.asarray(vt, np.float32).view(np.uint32)
        expected[f"{codec}/decoded_blake3"] = np.array(info["decoded_sha256"])
        expected[f"{codec}/decoded_sha256"] = np.array(R.decoded_digest(header, payload, "sha256"))
        expected[f"{codec}/payload_sha256"] = np.array(hashlib.sha256(payload).hexdigest())
    np.savez_compressed(EXPECTED, **expected)
    print(json.dumps({k: str(x) for k, x in expected.items() if "bits" not in k}, indent=1))


if __name__ == "__main__":
    main()
