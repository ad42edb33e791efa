"""Mutation fuzzer for what jaxguard parses from a guarded DCP directory: torch's pickled
``.metadata`` (through `torch_compat.dcp_metadata.load_metadata`) and the jaxguard
manifest in its planner data, then what `jaxguard verify` / `restore` / `inspect` do with
them (`torch_compat.dcp.verify_dir`, `load_full`, `inspect_dir`: range reads, hashes,
shard decode, assembly).

    nice -n 19 python bench/fuzz/fuzz_dcp_manifest.py --seconds 120 [--seed 0]

The seed is a real guarded DCP directory (the Adam state of tests/_dcp_worker.py's model,
one process).  Each execution writes a mutated ``.metadata`` beside the real rank file.
Mutations, at random: edits of the manifest tree (as bench/fuzz/fuzz_manifest.py: values,
huge/negative ints, deletions, insertions, duplicated or dropped shard records), of the
DCP structures (chunk offsets/sizes, tensor sizes, storage offsets/lengths, file names
with ``..`` or ``/``, dtypes, types swapped), pickles that name other callables
(``os.system``, ``builtins.eval``, ``torch.load``...), and raw byte edits of the pickle.

A finding is any exception other than a `jaxguard.errors.JaxguardError`, a multi-line
message, a refusal that only says torch failed (``torch.distributed.checkpoint failed``:
unchecked input reached torch), or a pickled callable that ran.  Findings and a few
inputs per distinct refusal go to tests/fuzz_corpus/dcp_manifest/ (``seed/`` holds the
directory); tests/optax/test_faults.py replays every case.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from fuzz_reader import get, paths  # noqa: E402
CORPUS = os.path.join(ROOT, "tests", "fuzz_corpus", "dcp_manifest")
CANARY = os.path.join(tempfile.gettempdir(), "jg_fuzz_dcp_canary")


def make_seed(out):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import _dcp_worker as W
    from torch_compat.dcp import GuardedSavePlanner
    model, opt = W.build(None)
    for s in range(3):
        W.train_step(model, opt, s, 0, 1)
    msd, osd = get_state_dict(model, opt)
    shutil.rmtree(out, ignore_errors=True)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out, planner=GuardedSavePlanner(), no_dist=True)
    md = pickle.load(open(os.path.join(out, ".metadata"), "rb"))
    md.storage_meta = dataclasses.replace(md.storage_meta, checkpoint_id=None)   # no machine-local path kept
    pickle.dump(md, open(os.path.join(out, ".metadata"), "wb"))
    del torch


# ---------------------------------------------------------------- mutations
VALUES = [0, 1, -1, 2, 7, 2 ** 31, 2 ** 63, -2 ** 63, 10 ** 30, True, False, None, 0.5, float("nan"), "", "x",
          "../../etc/passwd", "/abs", "__0_0.distcp", [], [0], [0, 0], [-1, 5], [1, 2 ** 62], {}, {"a": 1},
          "jaxguard-dcp/1", "exp_avg", [[[[[]]]]], [2 ** 40, 2 ** 40]]


class _Evil:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def evil_pickles():
    import builtins
    import torch
    touch = f"import pathlib; pathlib.Path({CANARY!r}).touch()"
    return [pickle.dumps(_Evil(os.system, (f"touch {CANARY}",))), pickle.dumps(_Evil(builtins.exec, (touch,))),
            pickle.dumps(_Evil(builtins.eval, (f"__import__('os').system('touch {CANARY}')",))),
            pickle.dumps(_Evil(torch.load, ("/nonexistent",))), pickle.dumps({"not": "metadata"}),
            pickle.dumps(_Evil(pickle.loads, (pickle.dumps(_Evil(os.system, (f"touch {CANARY}",))),)))]


def mutate_manifest(md, rnd):
    man = md.planner_data["__jaxguard__"]
    for _ in range(rnd.choice([1, 1, 2, 3])):
        ps = [p for p in paths(man) if p]
        p = rnd.choice(ps)
        parent, key = get(man, p[:-1]), p[-1]
        op = rnd.random()
        if op < 0.45:
            parent[key] = copy.deepcopy(rnd.choice(VALUES))
        elif op < 0.55 and isinstance(parent, dict):
            del parent[key]
        elif op < 0.6 and isinstance(parent, dict):
            parent[rnd.choice(["extra", "sha256", "bytes", "shape", "key"])] = rnd.choice(VALUES)
        elif op < 0.7 and isinstance(parent, list) and parent:
            parent.append(copy.deepcopy(parent[key])) if rnd.random() < 0.5 else parent.pop(key)
        elif op < 0.85 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] += rnd.choice([-1, 1, -4, 4, 1000, -parent[key], parent[key]])
        elif isinstance(parent[key], list) and parent[key] and all(isinstance(x, int) for x in parent[key]):
            i = rnd.randrange(len(parent[key]))
            parent[key][i] += rnd.choice([-1, 1, 8, -8, 2 ** 33])
        else:
            parent[key] = copy.deepcopy(rnd.choice(VALUES))


def mutate_dcp(md, rnd):
    import torch
    from torch.distributed.checkpoint import metadata as M
    op = rnd.random()
    sdm, sd = md.state_dict_metadata, md.storage_data
    if op < 0.3 and sd:
        idx = rnd.choice(list(sd))
        info = sd[idx]
        field = rnd.choice(["relative_path", "offset", "length"])
        val = rnd.choice(VALUES + ([info.offset + rnd.choice([-1, 1, 4096])] if field != "relative_path" else
                                   ["../__0_0.distcp", "sub/__0_0.distcp", ".metadata", ".", "missing.distcp"]))
        sd[idx] = dataclasses.replace(info, **{field: val})
    elif op < 0.4 and sd:
        idx = rnd.choice(list(sd))
        v = sd.pop(idx)
        if rnd.random() < 0.5:
            sd[M.MetadataIndex(rnd.choice(["x", idx.fqn + "!"]), idx.offset)] = v
    elif op < 0.75:
        k = rnd.choice(list(sdm))
        v = sdm[k]
        if isinstance(v, M.TensorStorageMetadata):
            w = rnd.random()
            if w < 0.3:
                v.size = torch.Size([max(0, d + rnd.choice([-1, 1, 7])) for d in v.size])
            elif w < 0.6 and v.chunks:
                c = rnd.choice(v.chunks)
                i = rnd.randrange(len(c.sizes)) if len(c.sizes) else 0
                which = rnd.choice(["offsets", "sizes"])
                t = list(getattr(c, which))
                if t:
                    t[i] = max(0, t[i] + rnd.choice([-1, 1, 5, 2 ** 20]))
                setattr(c, which, torch.Size(t))
            elif w < 0.8:
                v.properties.dtype = rnd.choice([torch.float64, torch.int8, torch.bfloat16, torch.bool])
            else:
                v.chunks = rnd.choice([[], v.chunks + v.chunks, None])
        else:
            sdm[k] = rnd.choice([None, 3, "x", M.TensorStorageMetadata(M.TensorProperties(torch.float32),
                                                                       torch.Size([2]), [])])
    elif op < 0.85:
        del sdm[rnd.choice(list(sdm))]
    else:
        md.planner_data = rnd.choice([None, {}, [], {"__jaxguard__": rnd.choice(VALUES)}])


def mutate_bytes(data, rnd):
    b = bytearray(data)
    for _ in range(rnd.choice([1, 2, 4])):
        op, i = rnd.random(), rnd.randrange(len(b))
        if op < 0.4:
            b[i] ^= 1 << rnd.randrange(8)
        elif op < 0.6:
            del b[i:]
        elif op < 0.8:
            b[i:i] = rnd.choice([b"(", b"}", b"\x94", b"cos\nsystem\n", b"\x8c\x02os\x8c\x06system\x93", b"\xff" * 8])
        else:
            b[i] = rnd.randrange(256)
        if not b:
            b = bytearray(b".")
    return bytes(b)


def run_one(work, data):
    from jaxguard.errors import JaxguardError
    from torch_compat import dcp as tdcp
    with open(os.path.join(work, ".metadata"), "wb") as fh:
        fh.write(data)
    try:
        tdcp.verify_dir(work)
        tdcp.inspect_dir(work)
        tdcp.load_full(work)
        res = "ok"
    except JaxguardError as exc:
        msg = str(exc)
        if "\n" in msg:
            res = ("finding", f"multi-line {type(exc).__name__}: {msg[:200]!r}")
        elif "torch.distributed.checkpoint failed" in msg:
            res = ("finding", f"unchecked input reached torch: {msg[:200]}")
        else:
            res = "refused:" + re.sub(r"\d+", "N", msg.replace(work, "DIR"))[:100]
    if os.path.exists(CANARY):
        os.unlink(CANARY)
        res = ("finding", "a pickled callable ran")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", default=CORPUS)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fuzz_dcp_manifest.json"))
    a = ap.parse_args()
    import resource
    import warnings
    warnings.filterwarnings("ignore")
    # a reader that allocates what a mutated length says fails here as a MemoryError (a finding), not by the OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    tmp = tempfile.mkdtemp(prefix="jg_fuzzdcp_")
    seed_dir = os.path.join(a.corpus, "seed")
    if not os.path.isdir(seed_dir):
        make_seed(seed_dir)
    work = os.path.join(tmp, "dir")
    shutil.copytree(seed_dir, work)
    seed = open(os.path.join(seed_dir, ".metadata"), "rb").read()
    assert run_one(work, seed) == "ok"
    rnd = random.Random(a.seed)
    os.makedirs(os.path.join(a.corpus, "cases"), exist_ok=True)
    execs, findings, kinds, kept = 0, {}, {}, 0
    pending = evil_pickles()
    t0 = time.time()
    while time.time() - t0 < a.seconds:
        if pending:
            data = pending.pop()
        elif rnd.random() < 0.25:
            data = mutate_bytes(seed, rnd)
        else:
            md = pickle.loads(seed)
            (mutate_manifest if rnd.random() < 0.55 else mutate_dcp)(md, rnd)
            try:
                data = pickle.dumps(md)
            except Exception:  # noqa: BLE001 - a mutation pickle cannot write is not an input
                continue
        try:
            res = run_one(work, data)
        except Exception as exc:  # noqa: BLE001 - every other exception is a finding
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            res = ("finding", f"{type(exc).__name__} at {os.path.basename(tb.filename)}:{tb.lineno}: {str(exc)[:120]}")
        execs += 1
        if isinstance(res, tuple):
            key = res[1][:60]
            if key not in findings:
                findings[key] = res[1]
                open(os.path.join(a.corpus, "cases", "finding-" + hashlib.sha256(data).hexdigest()[:12] + ".pkl"),
                     "wb").write(data)
                print("FINDING", res[1], flush=True)
            continue
        kinds[res] = kinds.get(res, 0) + 1
        if kinds[res] == 1 and kept < 60 and len(data) < 40000:
            kept += 1
            open(os.path.join(a.corpus, "cases", "refused-" + hashlib.sha256(data).hexdigest()[:12] + ".pkl"),
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
