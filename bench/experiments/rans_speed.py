"""rANS encode / decode of one container's ``mv_rans`` buffers, an older `rans.py` beside this
tree's, interleaved, medians of --repeats (a shared machine: compare the ratios).

    python bench/experiments/rans_speed.py CONTAINER.jg [--old-rev HEAD~1] [--repeats 5] [--tile 1]

The old module is `git show REV:jaxguard/format/rans.py`, loaded from a temp file.  Encode:
the old `rans.encode_streams` per buffer (as the guard's payload stat and the writer each called
it) vs this tree's `rans.encode_streams_many` of all buffers (once).  Decode: `decode_many` of all
buffers, old vs new.  Both must give the same bytes / symbols (checked).  --tile k repeats
the tensor set k times (a larger checkpoint of the same tensors).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_old(rev):
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:jaxguard/format/rans.py"], check=True,
                         capture_output=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "rans_old.py")
    with open(path, "wb") as fh:
        fh.write(src)
    spec = importlib.util.spec_from_file_location("rans_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("container")
    ap.add_argument("--old-rev", default="HEAD~1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tile", type=int, default=1)
    args = ap.parse_args()
    from jaxguard.format import rans, reader
    old = load_old(args.old_rev)
    with open(args.container, "rb") as fh:
        header, payload = reader.parse(fh.read())[:2]
    items = []
    for k, e in enumerate(header["entries"]):
        s = e.get("sections", {})
        if e.get("kind") == "moments" and "mv_rans" in s:
            n = int(np.prod(e["shape"], dtype=np.int64))
            items.append(reader._rans_item(e["name"], s, payload, n, max(1, -(-n // 256))))
    items = items * args.tile
    dec = rans.decode_streams_many(items, "mv", lane_tails=True)
    enc_items = [(sym.astype(np.int64), bits, n, None, tails) for (sym, tails), (_, bits, n) in zip(dec, items)]
    coords = sum(n for _, _, n in items)
    print(f"{len(items)} buffers, {coords} coordinates, {sum(len(b) for b, _, _ in items)} bytes")

    def old_encode():
        return [old.encode(s, b, n, lane_tails=t, compact_models=True) for s, b, n, _, t in enc_items]

    def new_encode():
        return rans.encode_streams_many(enc_items, compact_models=True, lane_tails=True)

    models = [rans.fit_models(s, b, n, compact=True) for s, b, n, _, _ in enc_items]
    fitted = [(s, b, n, m, t) for (s, b, n, _, t), m in zip(enc_items, models)]

    def old_loop():
        return [old.encode(s, b, n, m, lane_tails=t, compact_models=True) for s, b, n, m, t in fitted]

    def new_loop():
        return rans.encode_streams_many(fitted, compact_models=True, lane_tails=True)

    def fit():
        return [rans.fit_models(s, b, n, compact=True) for s, b, n, _, _ in enc_items]

    def old_decode():
        return old.decode_many(items, "mv", lane_tails=True)

    def new_decode():
        return rans.decode_streams_many(items, "mv", lane_tails=True)

    a, b = old_encode(), new_encode()
    assert a == b == [bytes(x) for x, _, _ in items], "encoders disagree"
    for (s1, t1), (s2, t2) in zip(old_decode(), new_decode()):
        assert (s1 == s2).all() and (t1 == t2).all(), "decoders disagree"
    pairs = {"encode (fit + code), per buffer vs many": (old_encode, new_encode),
             "lane loop only (models given)": (old_loop, new_loop),
             "decode_many": (old_decode, new_decode)}
    times = {k: ([], []) for k in pairs}
    fit_t = []
    for _ in range(args.repeats):
        for k, (fo, fn) in pairs.items():
            for f, acc in ((fo, times[k][0]), (fn, times[k][1])):
                t0 = time.perf_counter()
                f()
                acc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fit()
        fit_t.append(time.perf_counter() - t0)
    print(f"| step | old s | new s | new / old |")
    print(f"|---|---:|---:|---:|")
    for k, (to, tn) in times.items():
        mo, mn = statistics.median(to), statistics.median(tn)
        print(f"| {k} | {mo:.3f} | {mn:.3f} | {mn / mo:.2f} |")
    print(f"| model fit alone (fit_models, compact) | | {statistics.median(fit_t):.3f} | |")


if __name__ == "__main__":
    sys.exit(main())
