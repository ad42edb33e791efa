"""How much would rANS-coding logrel-aw's code streams save?  (issue 17, entropy coding probe)

    nice python bench/experiments/entropy_probe.py [--steps 20] [--out bench/experiments/results] [--cache bench/.cache]

Checkpoints: bench/logrel_aw.py's (the `bench/reproduce.py --tiny` conditions: CNN and
ByteTransformer, seed 701, 20 steps, checkpoints at 10/50/100%; and the demo checkpoint,
ByteTransformer seed 0, 150 steps), trained with `torch_compat.models.train` and cached.
Each is compressed with ``torch_compat.compress_checkpoint(ckpt, codec="logrel-aw")``
(tau = 0.01, C = 0.2); the container is parsed with the numpy reader and each tensor's m
and v code streams are re-coded with jaxguard.format.rans (actual encoded bytes, models
and lane states included), everything else (widths, block parameters, escapes) unchanged.
Variants per tensor (each keeps the packed stream where rANS is not smaller):

* ``rans-joint``: m and v share the lanes (one 32-bit state per block);
* ``rans-split``: one buffer per stream (two states per block);
* ``rans-joint+entropy-widths``: the guard's width chooser prices a block by its rANS
  bits under models fitted on a first (packed-priced) pass, instead of by packed bits.
  The chosen codes are certified by the guard exactly as logrel-aw's (same escapes logic).

Also: the order-0 entropy of the codes (per stream and width: the coder's floor without
model or state cost), and coder throughput next to packed.unpack on the demo codes.
Writes <out>/entropy_probe.json and entropy_probe.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

TAU, CLIP = 0.01, 0.2


def tensor_streams(data):
    """Container bytes -> per logrel-aw moments entry: dict of n, bm, bv, m/v symbols, section bytes."""
    from jaxguard.format import packed, reader
    header, payload = reader.parse(data)
    out = []
    for e in header["entries"]:
        if e.get("kind") != "moments":
            continue
        s = e["sections"]
        size = {k: b1 - b0 for k, (b0, b1) in s.items()}
        n = int(np.prod(e["shape"])) if e["shape"] else 1
        if e["codec"] != packed.CODEC:
            out.append({"name": e["name"], "n": n, "size": size, "aw": False})
            continue
        nb = max(1, -(-n // packed.BLOCK))
        sec = lambda k: np.frombuffer(payload[s[k][0]:s[k][1]], np.uint8)   # noqa: E731
        bm, bv = packed.split_widths(sec("widths"))
        mc = packed.unpack(sec("m_codes"), bm, n).reshape(nb, packed.BLOCK)
        vc = packed.unpack(sec("v_codes"), bv, n).reshape(nb, packed.BLOCK)
        out.append({"name": e["name"], "n": n, "size": size, "aw": True, "bm": bm, "bv": bv, "mc": mc, "vc": vc,
                    "m_params": sec("m_params").tobytes()})
    return out


def entropy_bits(t):
    """Order-0 entropy (bits) of a tensor's m and v codes, one distribution per stream and width."""
    total = 0.0
    coded = np.arange(256)[None] < np.minimum(256, t["n"] - 256 * np.arange(t["mc"].shape[0]))[:, None]
    for codes_, widths in ((t["mc"], t["bm"]), (t["vc"], t["bv"])):
        for w in np.unique(widths):
            sym = codes_[(widths == w)[:, None] & coded]
            p = np.bincount(sym) / sym.size
            p = p[p > 0]
            total -= sym.size * (p * np.log2(p)).sum()
    return total


def measure(streams):
    from jaxguard.format import rans
    r = {"payload": 0, "fp32": 0, "packed_codes": 0, "joint_codes": 0, "split_codes": 0, "entropy_codes": 0.0,
         "model_bytes": 0, "state_bytes": 0, "tensors": len(streams), "tensors_rans": 0, "tail_saved": 0}
    for t in streams:
        r["payload"] += sum(t["size"].values())
        r["fp32"] += 8 * t["n"]
        if not t["aw"]:
            continue
        pk = t["size"]["m_codes"] + t["size"]["v_codes"]
        sym, bits = np.stack([t["mc"], t["vc"]]), np.stack([t["bm"], t["bv"]])
        models = rans.fit_models(sym, bits, t["n"])
        joint = len(rans.encode_streams(sym, bits, t["n"], models))
        split = sum(min(len(rans.encode_streams(sym[k], bits[k], t["n"])), t["size"][key])
                    for k, key in ((0, "m_codes"), (1, "v_codes")))
        r["packed_codes"] += pk
        r["joint_codes"] += min(joint, pk)
        r["split_codes"] += split
        r["entropy_codes"] += entropy_bits(t) / 8
        if joint < pk:
            # the block's bfloat16 m-scale (m_params, 2 bytes) rides in the lane's initial state
            mp = np.frombuffer(t["m_params"], "<u2")
            r["tail_saved"] += joint + t["size"]["m_params"] - len(rans.encode_streams(sym, bits, t["n"], models, lane_tails=mp))
            r["tensors_rans"] += 1
            r["model_bytes"] += len(rans.encode_models(models))
            r["state_bytes"] += 4 * bits.shape[1]
    aw = [t for t in streams if t["aw"]]
    if aw:                      # one model set for the whole checkpoint, stored once
        sym = np.concatenate([np.stack([t["mc"], t["vc"]]) for t in aw], axis=1)
        bits = np.concatenate([np.stack([t["bm"], t["bv"]]) for t in aw], axis=1)
        coded = np.concatenate([np.arange(256)[None] < np.minimum(256, t["n"] - 256 * np.arange(t["mc"].shape[0]))[:, None]
                                for t in aw])
        shared = rans.fit_models(np.where(coded[None], sym, 0), bits, 256 * bits.shape[1])
        r["shared_model_bytes"] = len(rans.encode_models(shared))
        r["shared_codes"] = min(r["packed_codes"], r["shared_model_bytes"] + sum(
            min(len(rans.encode_streams(np.stack([t["mc"], t["vc"]]), np.stack([t["bm"], t["bv"]]), t["n"], shared,
                                inline_models=False)), t["size"]["m_codes"] + t["size"]["v_codes"]) for t in aw))
    other = r["payload"] - r["packed_codes"]
    r["pct"] = {"logrel-aw": 100 * r["payload"] / r["fp32"],
                "rans-joint": 100 * (other + r["joint_codes"]) / r["fp32"],
                "rans-split": 100 * (other + r["split_codes"]) / r["fp32"],
                "rans-joint, m-scale in lane tails": 100 * (other + r["joint_codes"] - r["tail_saved"]) / r["fp32"],
                "rans-joint, shared models": 100 * (other + r.get("shared_codes", r["packed_codes"])) / r["fp32"],
                "entropy floor": 100 * (other + r["entropy_codes"]) / r["fp32"]}
    return r


# ---------------------------------------------------------------- entropy-priced width choice
def entropy_chooser(orig):
    """choose_and_certify that prices blocks by rANS bits: pass 1 = the original (packed
    prices), models fitted on its codes, pass 2 = the same candidates priced by the models."""
    from jaxguard.core import codes
    from jaxguard.format import packed, rans

    def choose(mh, vh, ph, valid, vpos, in_tensor, classify, certify_fn, pairs=None):
        # widths <= 8 only (wide_pairs=()): the probe's rANS models are per 4..8-bit width
        mq, vq, mp, vp, widths = orig(mh, vh, ph, valid, vpos, in_tensor, classify, certify_fn, pairs, wide_pairs=())
        nb = mh.size // codes.BLOCK
        bm0, bv0 = packed.split_widths(widths)
        count = in_tensor.reshape(nb, codes.BLOCK).sum(1)
        lanes = count > 0
        lmq = np.asarray(mq, np.int64).reshape(nb, -1) + ((1 << (bm0 - 1)) - 1)[:, None]
        # one model per stream and width over the group (the real coder fits per tensor)
        keep = np.flatnonzero(lanes)
        sym = np.stack([lmq[keep], np.asarray(vq, np.int64).reshape(nb, -1)[keep]])
        sym = np.where(in_tensor.reshape(nb, -1)[keep][None], sym, 0)
        # pack the partial lanes' symbols at the front: fit on every in-tensor coordinate
        cost = rans.symbol_cost_bits(_fit_group(sym, np.stack([bm0[keep], bv0[keep]]),
                                                in_tensor.reshape(nb, -1)[keep]))

        def code_bits(cmq, cvq, bm, bv):
            fb_m, fb_v = bm + 2.0, bv + 2.0             # a symbol the first-pass model lacks
            cm = cost[0].get(bm)
            cv = cost[1].get(bv)
            mi, vi = cmq.astype(np.int64) + (1 << (bm - 1)) - 1, cvq.astype(np.int64)
            mbits = np.where(np.isfinite(cm[mi]), cm[mi], fb_m) if cm is not None else np.full(cmq.shape, fb_m)
            vbits = np.where(np.isfinite(cv[vi]), cv[vi], fb_v) if cv is not None else np.full(cvq.shape, fb_v)
            return mbits + vbits

        return orig(mh, vh, ph, valid, vpos, in_tensor, classify, certify_fn, pairs, code_bits=code_bits, wide_pairs=())

    return choose


def _fit_group(sym, bits, inb):
    """Per stream, width -> (P, freqs) over the in-tensor coordinates of these lanes."""
    from jaxguard.format import rans
    models = []
    for st in range(2):
        mods = {}
        for w in np.unique(bits[st]).tolist():
            hist = np.bincount(sym[st][(bits[st] == w)[:, None] & inb], minlength=1 << w)
            if hist.sum():
                mods[w] = (14, rans.quantize_levels(hist))
        models.append(mods)
    return models


# ---------------------------------------------------------------- speed
def speed(streams, reps=3):
    from jaxguard.format import packed, rans
    aw = [t for t in streams if t["aw"]]
    sym = np.concatenate([np.stack([t["mc"], t["vc"]]) for t in aw], axis=1)
    bits = np.concatenate([np.stack([t["bm"], t["bv"]]) for t in aw], axis=1)
    n = 256 * sym.shape[1]           # the demo's lanes as one batch (each partial lane padded)
    nsym = 2 * n

    def best(fn):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            ts.append(time.perf_counter() - t0)
        return min(ts), out
    te, buf = best(lambda: rans.encode_streams(sym, bits, n))
    td, dec = best(lambda: rans.decode_streams(buf, bits, n))
    assert (dec == sym).all()
    pm = packed.pack(sym[0].reshape(-1), bits[0], n)
    pv = packed.pack(sym[1].reshape(-1), bits[1], n)
    tu, _ = best(lambda: (packed.unpack(pm, bits[0], n), packed.unpack(pv, bits[1], n)))
    tp, _ = best(lambda: (packed.pack(sym[0].reshape(-1), bits[0], n), packed.pack(sym[1].reshape(-1), bits[1], n)))
    bufs = [(rans.encode_streams(np.stack([t["mc"], t["vc"]]), np.stack([t["bm"], t["bv"]]), t["n"]),
             np.stack([t["bm"], t["bv"]]), t["n"]) for t in aw]
    tpt = 0.0                         # per-tensor calls (a reader decoding entry by entry)
    for it in bufs:
        t0 = time.perf_counter()
        rans.decode_streams(*it)
        tpt += time.perf_counter() - t0
    tmany, dm = best(lambda: rans.decode_streams_many(bufs))      # every tensor's buffer in one lane loop
    assert all((d == np.stack([t["mc"], t["vc"]])).all() for d, t in zip(dm, aw))
    return {"symbols": nsym, "lanes": int(sym.shape[1]),
            "rans_encode_Msym_s": nsym / te / 1e6, "rans_decode_Msym_s": nsym / td / 1e6,
            "packed_pack_Msym_s": nsym / tp / 1e6, "packed_unpack_Msym_s": nsym / tu / 1e6,
            "rans_decode_per_tensor_s": tpt, "rans_decode_many_s": tmany, "tensors": len(aw), "rans_decode_batched_s": td,
            "packed_unpack_s": tu}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "experiments" / "results"))
    ap.add_argument("--cache", default=str(ROOT / "bench" / ".cache"))
    a = ap.parse_args(argv)
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~/.cache"), "jaxguard", "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    torch.set_num_threads(1)
    import reproduce
    import torch_compat
    from jaxguard.core import adaptive  # logrel-aw's width chooser (the core codec table calls it by module)
    from torch_compat import models
    t_run = time.perf_counter()
    load0 = os.getloadavg()
    cache = Path(a.cache)
    ckpts = []
    for kind in ("cnn", "transformer"):
        by_frac, _ = reproduce.checkpoints(kind, 701, a.steps, cache)
        for f in reproduce.FRACTIONS:
            ckpts.append((f"{kind} seed701 {a.steps} steps @{f:.0%}", by_frac[f]))
    demo_path = cache / "demo-transformer-seed0-steps150.pt"
    if demo_path.exists():
        demo = torch.load(demo_path, weights_only=False)
    else:
        demo, _, _ = models.train("transformer", seed=0, steps=150, fractions=(1.0,))
        cache.mkdir(parents=True, exist_ok=True)
        torch.save(demo, demo_path)
    ckpts.append(("demo transformer seed0 150 steps", demo[1.0]))
    rows, demo_streams = [], None
    orig = adaptive.choose_and_certify
    for label, ck in ckpts:
        data, s = torch_compat.compress_checkpoint(ck, tau=TAU, clip=CLIP, codec="logrel-aw")
        st = tensor_streams(data)
        r = measure(st)
        r.update(checkpoint=label, coordinates=s["coordinates"], escapes=s["escapes"],
                 summary_payload_ratio=s["payload_ratio"])
        adaptive.choose_and_certify = entropy_chooser(orig)
        try:
            data2, s2 = torch_compat.compress_checkpoint(ck, tau=TAU, clip=CLIP, codec="logrel-aw")
        finally:
            adaptive.choose_and_certify = orig
        r2 = measure(tensor_streams(data2))
        r["pct"]["logrel-aw, entropy-priced widths (packed)"] = r2["pct"]["logrel-aw"]
        r["pct"]["rans-joint+entropy-widths"] = r2["pct"]["rans-joint"]
        r["widths_changed_blocks"] = int(sum((a["bm"] != b["bm"]).sum() + (a["bv"] != b["bv"]).sum()
                                             for a, b in zip(st, tensor_streams(data2)) if a["aw"] and b["aw"]))
        r["pct"]["rans-joint, shared models+entropy-widths"] = r2["pct"]["rans-joint, shared models"]
        r["escapes_entropy_widths"] = s2["escapes"]
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items()}), flush=True)
        if label.startswith("demo"):
            demo_streams = st
    sp = speed(demo_streams)
    print(json.dumps(sp), flush=True)
    res = {"rows": rows, "speed": sp, "machine": reproduce.machine_info(), "loadavg_start": load0,
           "loadavg_end": os.getloadavg(), "seconds": time.perf_counter() - t_run, "tau": TAU, "clip": CLIP,
           "command": "nice python bench/experiments/entropy_probe.py --steps %d" % a.steps}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "entropy_probe.json").write_text(json.dumps(res, indent=1))
    write_md(out / "entropy_probe.md", res)


def write_md(path, res):
    cols = ["logrel-aw", "rans-split", "rans-joint", "rans-joint, m-scale in lane tails", "rans-joint, shared models",
            "entropy floor",
            "logrel-aw, entropy-priced widths (packed)", "rans-joint+entropy-widths",
            "rans-joint, shared models+entropy-widths"]
    L = ["# rANS on logrel-aw's code streams (bench/experiments/entropy_probe.py)", "",
         f"Command: `{res['command']}`.  tau = {res['tau']}, C = {res['clip']}; moments payload % of FP32 (container "
         "sections of the moments entries; the rANS columns replace the m/v code sections by the actual encoded "
         "bytes, models and lane states included, per tensor only where smaller).  Machine: "
         f"{res['machine']['platform']}, {res['machine']['cpu_count']} CPUs shared with other jobs (load average "
         f"{res['loadavg_start'][0]:.1f} at start, {res['loadavg_end'][0]:.1f} at end).", "",
         "| checkpoint | coords | escapes | " + " | ".join(cols) + " | models B | states B | tensors rANS/all |",
         "|---|---|---|" + "---|" * (len(cols) + 3)]
    for r in res["rows"]:
        L.append(f"| {r['checkpoint']} | {r['coordinates']:,} | {r['escapes']} | "
                 + " | ".join(f"{r['pct'][c]:.2f}" for c in cols)
                 + f" | {r['model_bytes']} | {r['state_bytes']} | {r['tensors_rans']}/{r['tensors']} |")
    sp = res["speed"]
    L += ["", f"## Speed (demo codes: {sp['symbols']:,} symbols in {sp['lanes']} lanes as one batch; best of 3; "
          "numpy, loaded 2-core machine)", "",
          "| | M symbols/s |", "|---|---|",
          f"| rans.encode_streams | {sp['rans_encode_Msym_s']:.1f} |", f"| rans.decode_streams | {sp['rans_decode_Msym_s']:.1f} |",
          f"| packed.pack | {sp['packed_pack_Msym_s']:.1f} |", f"| packed.unpack | {sp['packed_unpack_Msym_s']:.1f} |",
          "", f"The demo's {sp['tensors']} per-tensor buffers: `rans.decode_streams` one call each "
          f"{sp['rans_decode_per_tensor_s']:.3f} s; `rans.decode_streams_many` (one lane loop) {sp['rans_decode_many_s']:.3f} s; "
          f"one buffer of all lanes {sp['rans_decode_batched_s']:.3f} s; packed.unpack of the same codes "
          f"{sp['packed_unpack_s']:.4f} s.",
          "", f"Run took {res['seconds']:.0f} s.", ""]
    path.write_text("\n".join(L))


if __name__ == "__main__":
    main()
