"""Section-targeted mutation fuzzer for the logrel-aw, logrel-ans and log8-rel-zstd sections of
the numpy reader.

    nice python bench/fuzz/fuzz_reader_aw.py SECONDS [OUT_DIR] [--codec logrel-aw|logrel-ans|log8-rel-zstd|all]

Seeds, per codec: the odd-values checkpoint (sparse escape index, several entries) and a
tensor with a third of its coordinates escaped (bitmask); for logrel-ans also a container
of several larger tensors whose entries carry ``mv_rans`` sections (so the reader's
container-level `rans.decode_streams_many` pre-pass runs, and its per-entry fallback on error),
and a single-entry one (the one-buffer `rans.decode_streams` path); for both codecs a container of
two-population tensors whose blocks are 9..12 bits wide (packed fields of up to 12 bits; for
logrel-ans an ``mv_rans`` of rANS kind 4, and the golden file of the older layout with
``m_low`` / ``v_low`` sections); for log8-rel-zstd the same two-population tensors, whose
blocks the writer widens (``widths``, ``v_high``), and its golden container (streams of two
frames, the 20-byte parameter form, streams stored as is).  Each case overwrites 1-8 bytes
inside one section of one moments entry (random byte, 0xff, 0x00, 0x80 or a bit flip) and
reseals the payload and file hashes, so that the layout and decode checks are reached.
Anything other than ReaderError is a finding (crash-*); one input per distinct rejection
message is written to OUT_DIR (default /tmp/awfuzz2) for tests/fuzz_corpus
(``reject-aw-*`` / ``reject-ans-*`` / ``reject-zstd-*``).
"""
import collections
import hashlib
import os
import random
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
import numpy as np  # noqa: E402
from fuzz_reader import split, reseal  # noqa: E402
from jaxguard.format import reader  # noqa: E402
import torch_compat  # noqa: E402
from torch_compat.models import odd_values_checkpoint  # noqa: E402
import jaxguard.core.guard as G  # noqa: E402
from jaxguard.format import container  # noqa: E402


def _tensor(rng, n, nan_every=0):
    v = rng.lognormal(-14, 1, n).astype(np.float32)
    m = (rng.normal(0, 1, n) * np.sqrt(v) * .3).astype(np.float32)
    if nan_every:
        m[::nan_every] = np.nan
    return m, v, rng.normal(0, .05, n).astype(np.float32)


def _two_populations(rng, n, ratio=12.0):
    """v spanning ~30 binades in every block, |m|/sqrt(v) up to `ratio`: the blocks certify at
    9..12 bits (m_low, v_low)."""
    sv = np.where(rng.random(n) < 0.5, 2.0**-7, 2.0**-22) * rng.uniform(0.5, 2.0, n)
    v = (sv * sv).astype(np.float32)
    m = (rng.choice([-1.0, 1.0], n) * rng.uniform(0.05, ratio, n) * sv).astype(np.float32)
    return m, v, rng.normal(0, .05, n).astype(np.float32)


def seeds_for(codec):
    out = [torch_compat.compress_checkpoint(odd_values_checkpoint(), codec=codec)[0]]
    rng0 = np.random.default_rng(1)
    cfg = G.GuardConfig(lr=1e-3, step=100, codec=codec)
    out.append(container.build([container.Moments("x", G.encode(*_tensor(rng0, 256 * 8, 3), cfg), {})], {}))
    if codec == "logrel-ans":
        ents = [container.Moments(f"t{k}", G.encode(*_tensor(rng0, n), cfg), {})
                for k, n in enumerate((256 * 12 + 5, 256 * 3, 700))]
        out.append(container.build(ents, {}))
        out.append(container.build(ents[:1], {}))
        assert any("mv_rans" in e["sections"] for d in out for e in split(d)[0]["entries"]
                   if e.get("kind") == "moments"), "no seed has an mv_rans section"
    # 9..12-bit blocks: packed fields up to 12 bits; for logrel-ans an mv_rans of kind 4 (whole fields)
    wide = [container.Moments(f"w{k}", G.encode(*_two_populations(rng0, n), cfg), {})
            for k, n in enumerate((256 * 6 + 77, 256 * 2))]
    out.append(container.build(wide, {}))
    if codec == "log8-rel-zstd":
        hdr, _ = split(out[-1])
        assert any("widths" in e["sections"] for e in hdr["entries"] if e.get("kind") == "moments"), \
            "no widened log8-rel-zstd seed"
        with open(os.path.join(ROOT, "tests", "golden", "containers", "log8-rel-zstd.jaxguard"), "rb") as f:
            out.append(f.read())
    if codec == "logrel-ans":
        hdr, pay = split(out[-1])
        assert any(pay[e["sections"]["mv_rans"][0]] & 0x0F == 4 for e in hdr["entries"]
                   if e.get("kind") == "moments" and "mv_rans" in e["sections"]), "no kind-4 mv_rans seed"
        # the layout written before kind 4: mv_rans (kind 3) + m_low + v_low
        with open(os.path.join(ROOT, "tests", "golden", "containers", "logrel-ans-wide.jaxguard"),
                  "rb") as f:
            out.append(f.read())
    for d in out:
        reader.verify_bytes(d)
    return out


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    which = "both"
    if "--codec" in argv:
        which = argv[argv.index("--codec") + 1]
        args.remove(which)
    seconds = float(args[0])
    out = args[1] if len(args) > 1 else "/tmp/awfuzz2"
    codecs = {"both": ("logrel-aw", "logrel-ans"), "all": ("logrel-aw", "logrel-ans", "log8-rel-zstd")}.get(
        which, (which,))
    seeds = [(c, d) for c in codecs for d in seeds_for(c)]
    rng = random.Random(17)
    t0 = time.time()
    execs = 0
    msgs = collections.Counter()
    keep = {}
    while time.time() - t0 < seconds:
        codec, sd = rng.choice(seeds)
        h, p = split(sd)
        ents = [x for x in h['entries'] if x.get('kind') == 'moments']
        ent = rng.choice(ents)
        sec = rng.choice(sorted(ent['sections']))
        b, e2 = ent['sections'][sec]
        if e2 <= b:
            continue
        p = bytearray(p)
        for _ in range(rng.choice((1, 1, 2, 8))):
            i = rng.randrange(b, e2)
            p[i] = rng.choice((rng.randrange(256), 0xff, 0x00, 0x80, p[i] ^ (1 << rng.randrange(8))))
        data = reseal(h, bytes(p))
        execs += 1
        try:
            reader.verify_bytes(data)
            k = 'OK(decoded hash matched)'
        except reader.ReaderError as ex:
            k = sec + ': ' + re.sub(r'0x[0-9a-f]+|[0-9]+', '#', str(ex))[:90]
        except Exception as ex:  # a finding: the reader must only raise ReaderError
            k = 'FINDING ' + type(ex).__name__ + ' ' + str(ex)[:80]
        k = f"{codec} {k}"
        msgs[k] += 1
        if k not in keep:
            keep[k] = data
    print('execs', execs, 'seconds', round(time.time() - t0, 1), 'findings',
          sum(c for k, c in msgs.items() if ' FINDING ' in k))
    for k, c in msgs.most_common():
        print(c, k)
    os.makedirs(out, exist_ok=True)
    for k, d in keep.items():
        if ' OK(' in k:
            continue
        tag = 'crash' if ' FINDING ' in k else {'logrel-ans': 'reject-ans', 'log8-rel-zstd': 'reject-zstd'}.get(
            k.split(' ')[0], 'reject-aw')
        open(f'{out}/{tag}-{hashlib.sha256(d).hexdigest()[:12]}.bin', 'wb').write(d)


if __name__ == "__main__":
    main(sys.argv[1:])
