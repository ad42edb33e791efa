"""Mutation fuzzer for rANS buffers with compact models (kinds 3 and 4), aimed at the model bits.

    nice python bench/fuzz/fuzz_rans_models.py SECONDS

Seeds: compact-model buffers of 1 and 2 streams over widths 0..8 (kind 3) and 0..12 (kind 4:
a block wider than 8 bits; half the seeds) (smooth, gap-toothed,
one-symbol and all-symbol histograms, partial last blocks, with and without lane tails).
Each case either flips / overwrites 1-4 bytes of the model part (sometimes one byte of the
rest), or replaces the whole model part with random bytes of a random length; then decodes
with `rans.decode_streams` and `rans.decode_streams_many`.  Anything but RansError (one line) is a finding;
so is a decode that disagrees between the two entry points.  Prints counts per outcome.
"""
import collections
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import numpy as np  # noqa: E402

from jaxguard.format import rans  # noqa: E402


def seeds():
    rng = np.random.default_rng(5)
    out = []
    for k in range(32):
        S = 1 + k % 2
        n = int(rng.choice([1, 37, 256, 700, 256 * 5 + 3]))
        nb = -(-n // 256)
        bits = rng.integers(0, 9 if k % 2 == 0 else 13, size=(S, nb))
        half = (1 << bits)[:, :, None] // 2
        sym = np.round(rng.laplace(0, 1 + k, size=(S, nb, 256))) + half
        if k % 6 == 3:
            sym = (sym // 3) * 3
        elif k % 6 == 4:
            sym = np.broadcast_to(np.arange(256), sym.shape)
        elif k % 6 == 5:
            sym = np.zeros_like(sym)
        sym = np.clip(sym, 0, None).astype(np.int64) % (1 << bits)[:, :, None]
        coded = np.arange(256)[None] < np.minimum(256, n - 256 * np.arange(nb))[:, None]
        sym = np.where(coded[None], sym, 0).astype(np.uint8 if bits.max() <= 8 else np.uint16)
        tails = rng.integers(0, 1 << 16, nb) if k % 4 == 1 else None
        buf = rans.encode_streams(sym, bits, n, lane_tails=tails, compact_models=True)
        end = rans.decode_compact_models(buf, S, 1, max_width=rans.kind_max_width(buf[0]))[1]
        out.append((buf, bits, n, tails is not None, end, sym))
    return out


def main(argv):
    seconds = float(argv[0]) if argv else 60.0
    cases = seeds()
    rnd = random.Random(17)
    msgs = collections.Counter()
    t0, execs, slowest = time.time(), 0, 0.0
    while time.time() - t0 < seconds:
        buf, bits, n, tails, end, sym = rnd.choice(cases)
        b = bytearray(buf)
        if rnd.random() < 0.05:             # the other compact kind: 3 <-> 4 (models up to 8 / 12 bits)
            b[0] ^= rans.KIND_COMPACT ^ rans.KIND_COMPACT_WIDE
        elif rnd.random() < 0.2:            # a random model part of random length
            b = b[:1] + bytearray(rnd.randrange(256) for _ in range(rnd.randrange(0, 2 * end))) + b[end:]
        else:
            for _ in range(rnd.choice((1, 1, 2, 4))):
                i = rnd.randrange(1, end) if rnd.random() < 0.9 or end >= len(b) else rnd.randrange(end, len(b))
                b[i] = rnd.choice((rnd.randrange(256), 0xFF, 0x00, 0x80, b[i] ^ (1 << rnd.randrange(8))))
        execs += 1
        t = time.perf_counter()
        try:
            one = rans.decode_streams(bytes(b), bits, n, lane_tails=tails)
            many = rans.decode_streams_many([(bytes(b), bits, n)], lane_tails=tails)[0]
            got = one[0] if tails else one
            same = all(np.array_equal(x, y) for x, y in zip(one, many)) if tails else np.array_equal(one, many)
            k = "FINDING decode != decode_many" if not same else (
                "OK same symbols" if np.array_equal(got, sym) else "OK other valid message")
        except rans.RansError as exc:
            k = "refused: " + re.sub(r"[0-9]+", "#", str(exc))[:80]
            if "\n" in str(exc):
                k = "FINDING multi-line error"
        except Exception as exc:  # a finding: only RansError may leave the decoder
            k = f"FINDING {type(exc).__name__} {str(exc)[:80]}"
        slowest = max(slowest, time.perf_counter() - t)
        msgs[k] += 1
    print("execs", execs, "seconds", round(time.time() - t0, 1), "slowest decode s", round(slowest, 3),
          "findings", sum(c for k, c in msgs.items() if k.startswith("FINDING")))
    for k, c in msgs.most_common():
        print(c, k)


if __name__ == "__main__":
    main(sys.argv[1:])
