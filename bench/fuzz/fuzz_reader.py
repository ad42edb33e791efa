"""Mutation fuzzer for the numpy-only container reader (`jaxguard.format.reader.verify_bytes`).

    nice -n 19 python bench/fuzz/fuzz_reader.py --seconds 600 [--seed 0] [--corpus tests/fuzz_corpus]

Starts from valid containers (a small torch Linear model + Adam state with NaN/Inf/negative
moments, codecs log8, block8, bf16 and logrel-aw; each written with BLAKE3, the integrity
hash of new files, and resealed with SHA-256, the older files' hash) and applies, at random:

* raw mutations: bit flips, byte insert/delete/overwrite, truncation, appends (these stop
  at the trailing digest almost always);
* *consistent* mutations that recompute the trailing digest (with the hash the prefix's
  flags name, SHA-256 for an unknown id) and, where the header is edited, `payload_sha256`
  too, so they reach the header, layout and decode checks: header JSON value edits (ints,
  huge ints, negatives, bools, lists, dicts, strings, null, NaN, deep nesting; the ``hash``
  field too), key deletion/insertion, raw header-text edits, payload byte edits, prefix
  field edits (version, flags: unknown bits and hash ids, header length).

Any exception other than `ReaderError` is a finding.  Findings and a few inputs per
distinct rejection message are written to the corpus directory; tests/format/test_reliability.py
replays the corpus (each file must raise ReaderError or verify cleanly).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import struct
import sys
import time
import traceback

from jaxguard.format import integrity, reader
from jaxguard.format.reader import PREFIX, TRAILER, ReaderError


def make_seeds():
    """Valid containers from a tiny torch model (needs torch + jax; run once)."""
    import numpy as np
    import torch_compat
    from torch_compat.models import odd_values_checkpoint

    seeds = []
    for codec in ("log8", "block8", "bf16", "logrel-aw"):
        data, _ = torch_compat.compress_checkpoint(odd_values_checkpoint(), codec=codec)
        reader.verify_bytes(data)
        seeds += [data, rehash(data, "sha256")]
        reader.verify_bytes(seeds[-1])
    return seeds


def rehash(data, name):
    """A valid container `data` resealed with the integrity hash `name`: prefix flags,
    header ``hash``, both header digests and the trailer."""
    header, payload = reader.parse(data)
    header = {k: v for k, v in header.items() if k != "hash"}
    if name != "sha256":
        header["hash"] = name
    header["decoded_sha256"] = reader.decoded_digest(header, payload, name)
    return reseal(header, bytes(payload), flags=integrity.hash_flags(name))


# ---------------------------------------------------------------- container surgery
def split(data):
    _, _, flags, hlen = PREFIX.unpack_from(data, 0)
    hb = data[PREFIX.size:PREFIX.size + hlen]
    payload = data[PREFIX.size + hlen:len(data) - TRAILER]
    return json.loads(hb), payload, flags


def _digest(name, data):
    h = integrity.hasher(integrity.HASHES.get(name, "sha256") if isinstance(name, int) else name)
    h.update(data)
    return h


def assemble(header_bytes, payload, *, version=1, flags=0, hlen=None):
    """A container whose trailer is the digest of the hash `flags` names (SHA-256 for an unknown id)."""
    body = PREFIX.pack(reader.MAGIC, version, flags, len(header_bytes) if hlen is None else hlen) + header_bytes + payload
    return body + _digest(flags, body).digest()


def reseal(header, payload, *, fix_payload_hash=True, flags=0):
    header = dict(header) if isinstance(header, dict) else header
    if fix_payload_hash and isinstance(header, dict):
        header["payload_bytes"] = len(payload)
        header["payload_sha256"] = _digest(flags, payload).hexdigest()
    return assemble(json.dumps(header, separators=(",", ":")).encode(), payload, flags=flags)


def weird_value(rng):
    c = rng.randrange(16)
    return [0, -1, 1, 2**31, 2**63, 2**64 + 5, -(2**63) - 1, True, False, None, "", "x" * rng.randrange(50),
            [], {}, [1, 2, 3], float("nan")][c] if c < 16 else None


def deep(n):
    return json.loads("[" * n + "]" * n) if n < 900 else None


def paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, prefix + (i,))


def get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def mutate_header(header, rng):
    h = copy.deepcopy(header)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        all_paths = [p for p in paths(h) if p]
        if not all_paths:
            break
        path = rng.choice(all_paths)
        parent = get(h, path[:-1])
        key = path[-1]
        cur = parent[key]
        op = rng.randrange(8)
        if op == 0 and isinstance(parent, dict):
            del parent[key]
        elif op == 1 and isinstance(cur, int) and not isinstance(cur, bool):
            parent[key] = cur + rng.choice((-257, -8, -4, -2, -1, 1, 2, 4, 8, 256, 10**6))
        elif op == 2 and isinstance(cur, list) and cur:
            if rng.random() < 0.5:
                cur.pop(rng.randrange(len(cur)))
            else:
                cur.append(copy.deepcopy(rng.choice(cur)))
        elif op == 3 and isinstance(cur, list) and len(cur) >= 2:
            i, j = rng.sample(range(len(cur)), 2)
            cur[i], cur[j] = cur[j], cur[i]
        elif op == 4 and isinstance(parent, dict):
            parent[rng.choice(["x", "codec", "kind", "shape", "sections", "name", "offsets", "dtype"])] = weird_value(rng)
        elif op == 5:
            parent[key] = rng.choice(["log8", "bf16", "block8", "block8-unguarded", "raw", "moments",
                                      "float32", "bfloat16", "bool", "int8", "float64", "nope", "sha256", "blake3"])
        elif op == 6 and isinstance(cur, dict) and cur:
            # swap two section ranges, or move a range
            ks = list(cur)
            a, b = rng.choice(ks), rng.choice(ks)
            cur[a], cur[b] = cur[b], cur[a]
        else:
            parent[key] = weird_value(rng)
    return h


def mutate(seed, rng):
    """Return (kind, bytes)."""
    data = bytearray(seed)
    r = rng.random()
    if r < 0.15:  # raw bit flips
        for _ in range(rng.choice((1, 1, 2, 8))):
            i = rng.randrange(len(data) * 8)
            data[i // 8] ^= 1 << (i % 8)
        return "bitflip", bytes(data)
    if r < 0.22:  # insert / delete / truncate / append
        i = rng.randrange(len(data) + 1)
        op = rng.randrange(4)
        if op == 0:
            data[i:i] = os.urandom(rng.choice((1, 2, 8, 100)))
        elif op == 1:
            del data[i:i + rng.choice((1, 2, 8, 100))]
        elif op == 2:
            del data[i:]
        else:
            data += os.urandom(rng.choice((1, 32, 100)))
        return "insdel", bytes(data)
    header, payload, flags = split(seed)
    if r < 0.70:  # structured header edit, resealed
        return "header", reseal(mutate_header(header, rng), payload, fix_payload_hash=rng.random() < 0.9, flags=flags)
    if r < 0.78:  # raw header-text edit, resealed
        hb = bytearray(json.dumps(header, separators=(",", ":")).encode())
        for _ in range(rng.choice((1, 2, 4))):
            i = rng.randrange(len(hb))
            op = rng.randrange(3)
            if op == 0:
                hb[i] = rng.choice(b'{}[]",:0123456789-eE.tfnx\\\x00\xff ')
            elif op == 1:
                del hb[i]
            else:
                hb[i:i] = bytes([rng.choice(b'{}[]",:019-e\\')])
        return "htext", assemble(bytes(hb), payload, flags=flags)
    if r < 0.82:  # deep nesting / huge numbers in the header text
        op = rng.randrange(3)
        if op == 0:
            n = rng.choice((100, 1000, 5000, 100000))
            hb = b'{"entries":[' + b"[" * n + b"]" * n + b"]}"
        elif op == 1:
            hb = b'{"entries":[],"payload_bytes":' + b"9" * rng.choice((20, 5000)) + b"}"
        else:
            h = dict(header)
            h["payload_bytes"] = 10 ** rng.choice((3, 30))
            hb = json.dumps(h).encode().replace(str(h["payload_bytes"]).encode(), b"1" * 5000)
        return "hjson", assemble(hb, payload, flags=flags)
    if r < 0.92:  # payload byte edits, payload hash (and file hash) recomputed
        p = bytearray(payload)
        for _ in range(rng.choice((1, 1, 4, 32))):
            i = rng.randrange(len(p))
            p[i] = rng.randrange(256)
        h = dict(header)
        return "payload", reseal(h, bytes(p), flags=flags)
    # prefix edits with a valid trailer
    hb = json.dumps(header, separators=(",", ":")).encode()
    op = rng.randrange(4)
    if op == 0:
        return "prefix", assemble(hb, payload, version=rng.choice((0, 2, 2**32 - 1)), flags=flags)
    if op == 1:
        return "prefix", assemble(hb, payload, flags=1 << rng.randrange(32))
    if op == 2:   # another or an unknown hash id, the trailer made with the hash it names
        return "prefix", assemble(hb, payload, flags=rng.choice((0, 1, 2, 3, 0xFF)))
    return "prefix", assemble(hb, payload, hlen=rng.choice((0, 1, len(hb) - 1, len(hb) + 1, 2**40, 2**64 - 1)),
                              flags=flags)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fuzz_corpus"))
    ap.add_argument("--max-interesting", type=int, default=40)
    a = ap.parse_args(argv)
    os.makedirs(a.corpus, exist_ok=True)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))
    seeds = make_seeds()
    rng = random.Random(a.seed)
    t0 = time.perf_counter()
    execs = ok = rejected = 0
    findings: dict = {}
    messages: dict = {}
    kinds: dict = {}
    while time.perf_counter() - t0 < a.seconds:
        kind, data = mutate(rng.choice(seeds), rng)
        execs += 1
        kinds[kind] = kinds.get(kind, 0) + 1
        try:
            reader.verify_bytes(data)
            ok += 1
        except ReaderError as exc:
            rejected += 1
            msg = str(exc)
            key = "".join(ch for ch in msg[:40] if not ch.isdigit())
            if key not in messages and len(messages) < a.max_interesting and kind not in ("bitflip", "insdel"):
                messages[key] = msg
                with open(os.path.join(a.corpus, f"reject-{kind}-{hashlib.sha256(data).hexdigest()[:12]}.bin"), "wb") as fh:
                    fh.write(data)
        except BaseException as exc:  # noqa: BLE001 - a finding
            if isinstance(exc, KeyboardInterrupt):
                raise
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            key = (type(exc).__name__, os.path.basename(tb.filename), tb.lineno)
            if key not in findings:
                fname = f"crash-{type(exc).__name__}-{hashlib.sha256(data).hexdigest()[:12]}.bin"
                if len(data) < 2_000_000:
                    with open(os.path.join(a.corpus, fname), "wb") as fh:
                        fh.write(data)
                findings[key] = {"count": 0, "example": str(exc)[:200], "file": fname, "kind": kind}
                print(f"FINDING {key}: {str(exc)[:200]} -> {fname}", flush=True)
            findings[key]["count"] += 1
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": round(dt, 1), "executions": execs, "exec_per_s": round(execs / dt, 1),
                      "verified_ok": ok, "rejected": rejected, "by_mutation": kinds,
                      "distinct_rejections": len(messages),
                      "findings": [{"type": k[0], "where": f"{k[1]}:{k[2]}", **v} for k, v in findings.items()]},
                     indent=1), flush=True)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
