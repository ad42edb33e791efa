"""Mutation fuzzer for the sharded checkpoint's manifest reader (`jaxguard.sharded.read_manifest`
and what `jaxguard.load` does with it: file checks, range reads, shard decode, assembly).

    nice -n 19 python bench/fuzz_manifest.py --seconds 120 [--seed 0] [--corpus tests/fuzz_corpus/sharded_manifest]

The seed is a real sharded directory (an optax adamw state over 2 CPU devices, so every
leaf has 2 shards in one process file).  Each execution writes a mutated ``manifest.json``
beside the real process file and calls ``jaxguard.load(dir, like)`` then
``jaxguard.sharded.verify(dir)``.  Mutations, at random: JSON value edits at a random
place of the tree (ints, huge and negative ints, bools, floats, NaN, strings, paths with
``..``, null, lists, dicts, deep nesting), key deletion and insertion, list element
duplication/removal, shard records moved between entries or files, byte ranges and
shapes shifted, and raw byte edits of the JSON text (flips, truncation, insertion).

Any exception other than a `jaxguard.errors.JaxguardError` is a finding; so is a
multi-line message.  Findings and a few inputs per distinct refusal are written to the
corpus (``seed/`` holds the process file and its real manifest); tests/optax/test_sharded.py
replays every case (each must load or raise a one-line JaxguardError).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import traceback

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from fuzz_reader import get, paths  # noqa: E402  (the JSON walk the container fuzzer mutates by)
CORPUS = os.path.join(ROOT, "tests", "fuzz_corpus", "sharded_manifest")


def seed_state():
    """(tx, params, state): the small adamw state of the seed (the tests' builder,
    tests/optax_states.py; the replay test rebuilds its structure)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from optax_states import trained_adamw
    return trained_adamw((8, 16), steps=3)


def make_seed(out):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxguard as jg
    tx, params, st = seed_state()
    mesh = Mesh(jax.devices()[:2], ("x",))

    def put(x):
        sh = NamedSharding(mesh, P("x") if x.ndim else P())
        return jax.device_put(x, sh)
    params, st = jax.tree_util.tree_map(put, params), jax.tree_util.tree_map(put, st)
    shutil.rmtree(out, ignore_errors=True)
    jg.save(out, st, params, lr=1e-3, weight_decay=1e-2, sharded=True)


# ---------------------------------------------------------------- mutations
VALUES = [0, 1, -1, 2, 7, 2 ** 31, 2 ** 63, -2 ** 63, 10 ** 30, True, False, None, 0.5, float("nan"), "", "x",
          "../../etc/passwd", "/abs", "process_00000.jaxguard", [], [0], [0, 0], [-1, 5], [1, 2 ** 62], {}, {"a": 1},
          "raw", "moments", "mu", "nu", "float32", "bfloat16", "object", [[[[[]]]]], [2 ** 40, 2 ** 40]]


def mutate_json(man, rnd):
    m = copy.deepcopy(man)
    for _ in range(rnd.choice([1, 1, 2, 3])):
        ps = list(paths(m))
        p = rnd.choice(ps[1:])
        parent, key = get(m, p[:-1]), p[-1]
        op = rnd.random()
        if op < 0.45:
            parent[key] = copy.deepcopy(rnd.choice(VALUES))
        elif op < 0.55 and isinstance(parent, dict):
            del parent[key]
        elif op < 0.6 and isinstance(parent, dict):
            parent[rnd.choice(["extra", "sha256", "bytes", "shape", "kind"])] = rnd.choice(VALUES)
        elif op < 0.7 and isinstance(parent, list) and parent:
            if rnd.random() < 0.5:
                parent.append(copy.deepcopy(parent[key]))
            else:
                parent.pop(key)
        elif op < 0.85 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] += rnd.choice([-1, 1, -4, 4, 1000, -parent[key], parent[key]])
        elif isinstance(parent[key], list) and parent[key] and all(isinstance(x, int) for x in parent[key]):
            i = rnd.randrange(len(parent[key]))
            parent[key][i] += rnd.choice([-1, 1, 8, -8, 2 ** 33])
        elif "shards" in m and isinstance(m["shards"], dict) and len(m["shards"]) > 1:
            a, b = rnd.sample(sorted(m["shards"]), 2)
            m["shards"][a], m["shards"][b] = m["shards"][b], m["shards"][a]
        else:
            parent[key] = copy.deepcopy(rnd.choice(VALUES))
    return json.dumps(m, separators=(",", ":")).encode()


def mutate_bytes(data, rnd):
    b = bytearray(data)
    for _ in range(rnd.choice([1, 2, 4])):
        op = rnd.random()
        i = rnd.randrange(len(b))
        if op < 0.4:
            b[i] ^= 1 << rnd.randrange(8)
        elif op < 0.6:
            del b[i:]
        elif op < 0.8:
            b[i:i] = rnd.choice([b"[", b"{", b"9" * 40, b'"', b",", b"\xff", b"[" * 5000])
        else:
            b[i] = rnd.randrange(256)
        if not b:
            b = bytearray(b"{")
    return bytes(b)


def run_one(work, data, like):
    import jaxguard as jg
    from jaxguard import sharded
    with open(os.path.join(work, "manifest.json"), "wb") as fh:
        fh.write(data)
    try:
        jg.load(work, like)
        sharded.verify(work)
        return "ok"
    except jg.JaxguardError as exc:
        msg = str(exc)
        if "\n" in msg:
            return ("finding", f"multi-line {type(exc).__name__}: {msg[:200]!r}")
        return "refused:" + re.sub(r"\d+", "N", msg.split(":", 1)[-1])[:90]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", default=CORPUS)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fuzz_manifest.json"))
    a = ap.parse_args()
    import jax
    import numpy as np
    tmp = tempfile.mkdtemp(prefix="jg_fuzzman_")
    seed_dir = os.path.join(a.corpus, "seed")
    if not os.path.isdir(seed_dir):
        make_seed(seed_dir)
    work = os.path.join(tmp, "dir")
    shutil.copytree(seed_dir, work)
    seed = open(os.path.join(seed_dir, "manifest.json"), "rb").read()
    man = json.loads(seed)
    tx, params, _ = seed_state()
    like = jax.tree_util.tree_map(np.asarray, tx.init(params))
    assert run_one(work, seed, like) == "ok"
    rnd = random.Random(a.seed)
    os.makedirs(os.path.join(a.corpus, "cases"), exist_ok=True)
    execs, findings, kinds, kept = 0, {}, {}, 0
    t0 = time.time()
    while time.time() - t0 < a.seconds:
        data = mutate_json(man, rnd) if rnd.random() < 0.8 else mutate_bytes(seed, rnd)
        try:
            res = run_one(work, data, like)
        except Exception as exc:  # noqa: BLE001 - every other exception is a finding
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            res = ("finding", f"{type(exc).__name__} at {os.path.basename(tb.filename)}:{tb.lineno}: {str(exc)[:120]}")
        execs += 1
        if isinstance(res, tuple):
            key = res[1][:60]
            if key not in findings:
                findings[key] = res[1]
                name = "finding-" + hashlib.sha256(data).hexdigest()[:12] + ".json"
                open(os.path.join(a.corpus, "cases", name), "wb").write(data)
                print("FINDING", res[1], flush=True)
            continue
        kinds[res] = kinds.get(res, 0) + 1
        if kinds[res] == 1 and kept < 60 and len(data) < 20000:
            kept += 1
            open(os.path.join(a.corpus, "cases", "refused-" + hashlib.sha256(data).hexdigest()[:12] + ".json"),
                 "wb").write(data)
    out = {"executions": execs, "seconds": round(time.time() - t0, 1), "seed": a.seed,
           "findings": sorted(findings.values()), "distinct_outcomes": len(kinds),
           "outcomes": dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:40]),
           "machine": "2-core AMD EPYC, shared with other work"}
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps({k: out[k] for k in ("executions", "seconds", "findings", "distinct_outcomes")}))
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
