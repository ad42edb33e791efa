"""Compact rANS models (kind 3) against 4-bit-level models (kind 1) on logrel-ans (issue 17).

    nice python bench/experiments/compact_models.py [--out bench/experiments/results] [--cache bench/.cache]

Checkpoints: bench/reproduce.py's (``checkpoints(kind, seed, steps, cache)``): the CNN
(ResidualCNN, 300 steps) seeds 701 and 702 at 10% and 100% of training, the
ByteTransformer (400 steps) seed 701 at 10/50/100%; and the demo checkpoint
(ByteTransformer seed 0, 150 steps) for the speed rows.  tau = 0.01, C = 0.2.

Per checkpoint: ``compress_checkpoint(ckpt, codec="logrel-aw")`` and each tensor's code
streams re-coded exactly as the logrel-ans writer does (jaxguard.format.packed
entry_sections: one rANS buffer of both streams, the bf16 m-scales in the lane tails, kept
only where smaller than the packed m_codes + v_codes + m_params):

* ``before``: kind-1 models only (4 bits per symbol of each width's alphabet; the rule of
  main before this change);
* ``after``: the smaller of kind 3 (compact) and kind 1, i.e. the writer of this branch;
  checked against the payload of the real ``compress_checkpoint(codec="logrel-ans")``;
* ``entropy floor``: the code streams at their order-0 entropy per stream and width
  (exact frequencies, no models, no lane states; m_params still stored);
* ``m|v context``: an estimate (no format) of conditioning each m code on the top 3 bits
  of its block's v code: per tensor the m stream's compact model bits + coded bits with
  one model per m width, against one per (m width, context); the saving is reported as
  points of FP32 where it pays, per checkpoint.

The logrel-ans containers are restored with torch_compat and audited with the real
``torch.optim.Adam`` (next-batch gradient + the gradient grid), and their decoded moments
compared with the logrel-aw container's (the model kind only changes bytes).
Speed: rans decode (``decode_many`` of the demo's per-tensor buffers, and one buffer of all
its lanes) with kind-1 and with kind-3 models, and the writer's encode time per kind.
Writes <out>/compact_models.json and compact_models.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

TAU, CLIP = 0.01, 0.2
CKPTS = [("cnn", 701, 300, 0.1), ("cnn", 701, 300, 1.0), ("cnn", 702, 300, 0.1), ("cnn", 702, 300, 1.0),
         ("transformer", 701, 400, 0.1), ("transformer", 701, 400, 0.5), ("transformer", 701, 400, 1.0)]


def _sym(t):
    return np.stack([t["mc"], t["vc"]]).astype(np.int64), np.stack([t["bm"], t["bv"]])


def recode(streams):
    """Per checkpoint sums: payload before/after, model bytes, tensors in rANS, the floor."""
    from entropy_probe import entropy_bits
    from jaxguard.format import rans
    r = {"fp32": 0, "other": 0, "before": 0, "after": 0, "floor": 0.0, "tensors": len(streams),
         "rans_before": 0, "rans_after": 0, "compact_chosen": 0, "inline_chosen": 0,
         "model_bytes_before": 0, "model_bytes_after": 0, "ctx_saved_bits": 0.0, "ctx_tensors": 0}
    for t in streams:
        r["fp32"] += 8 * t["n"]
        if not t["aw"]:
            r["other"] += sum(t["size"].values())
            continue
        codes = t["size"]["m_codes"] + t["size"]["v_codes"] + t["size"]["m_params"]
        r["other"] += sum(t["size"].values()) - codes
        sym, bits = _sym(t)
        tails = np.frombuffer(t["m_params"], "<u2")
        kind1 = len(rans.encode_streams(sym, bits, t["n"], lane_tails=tails))
        kind3 = len(rans.encode_streams(sym, bits, t["n"], lane_tails=tails, compact_models=True))
        r["before"] += min(kind1, codes)
        r["after"] += min(kind1, kind3, codes)
        if kind1 < codes:
            r["rans_before"] += 1
            r["model_bytes_before"] += len(rans.encode_models(rans.fit_models(sym, bits, t["n"])))
        if min(kind1, kind3) < codes:
            r["rans_after"] += 1
            if kind3 <= kind1:
                r["compact_chosen"] += 1
                r["model_bytes_after"] += len(rans.encode_compact_models(rans.fit_models(sym, bits, t["n"],
                                                                                         compact=True)))
            else:
                r["inline_chosen"] += 1
                r["model_bytes_after"] += len(rans.encode_models(rans.fit_models(sym, bits, t["n"])))
        r["floor"] += entropy_bits(t) / 8 + t["size"]["m_params"]
        saved = context_saving_bits(t)
        if saved > 0:
            r["ctx_saved_bits"] += saved
            r["ctx_tensors"] += 1
    for k in ("before", "after", "floor"):
        r[f"pct_{k}"] = 100 * (r["other"] + r[k]) / r["fp32"]
    r["pct_ctx_saving"] = 100 * r["ctx_saved_bits"] / 8 / r["fp32"]
    return r


def _stream_bits(hists):
    """Compact model + coded bits of one stream given {key: (width, histogram)}."""
    from jaxguard.format import rans, rans_models
    total = 0.0
    for w, h in hists.values():
        if not h.any():
            continue
        p, lv = rans.fit_compact_model(h, w, [p for p in rans.PROB_BITS if p >= w])
        total += rans_models.coded_bits(h, rans.model_freqs(lv, p), p) + rans.compact_model_bits(lv, w)
    return total


def context_saving_bits(t):
    """m stream bits (compact models) with one model per m width minus one per (m width,
    top 3 bits of the v code); 4 bits per extra model count of the contexts."""
    n, bm, bv = t["n"], t["bm"], t["bv"]
    nb = bm.size
    coded = np.arange(256)[None] < np.minimum(256, n - 256 * np.arange(nb))[:, None]
    ctx = t["vc"].astype(np.int64) >> np.maximum(bv - 3, 0)[:, None]
    plain, cond = {}, {}
    for w in np.unique(bm).tolist():
        sel = (bm == w)[:, None] & coded
        plain[w] = (w, np.bincount(t["mc"][sel], minlength=1 << w))
        for c in range(8):
            cond[(w, c)] = (w, np.bincount(t["mc"][sel & (ctx == c)], minlength=1 << w))
    return _stream_bits(plain) - _stream_bits(cond) - 4 * 7


def audit_and_compare(label, kind, ck, data_aw, tmp):
    """Real torch audit of the logrel-ans container; its decoded moments vs logrel-aw's."""
    import reproduce
    import torch_compat
    from jaxguard.format import reader
    from jaxguard.format.container import atomic_write
    from jaxguard.audit import gradient_grid
    data, s = torch_compat.compress_checkpoint(ck, tau=TAU, clip=CLIP, codec="logrel-ans")
    path = os.path.join(tmp, "ans.jg")
    atomic_write(path, data)
    restored, _ = torch_compat.restore_tree(path)
    a = torch_compat.audit(ck, restored, tau=TAU, clip=CLIP, grads=reproduce.real_gradient(kind, ck),
                           grid=gradient_grid(CLIP))
    same = reader.decoded_digest(*reader.parse(data)) == reader.decoded_digest(*reader.parse(data_aw))
    h, p = reader.parse(data)
    kinds = [int(p[e["sections"]["mv_rans"][0]]) for e in h["entries"]
             if e.get("kind") == "moments" and "mv_rans" in e["sections"]]
    return {"writer_payload_ratio": s["payload_ratio"], "max_gap_lr": a["max_gap_lr"],
            "violations": a["violations"], "audit_coordinates": a["coordinates"], "decoded_equal_to_aw": same,
            "kind_bytes": sorted(kinds)}


def speed(streams, reps=3):
    from jaxguard.format import rans
    aw = [t for t in streams if t["aw"]]

    def best(fn):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            ts.append(time.perf_counter() - t0)
        return min(ts), out
    res = {"tensors": len(aw), "symbols": int(sum(2 * t["n"] for t in aw))}
    for name, compact in (("kind1", False), ("kind3", True)):
        te, bufs = best(lambda: [(rans.encode_streams(*_sym(t), t["n"], compact_models=compact),) + _sym(t)[1:] + (t["n"],)
                                 for t in aw])
        td, dec = best(lambda: rans.decode_streams_many(bufs))
        assert all((d == _sym(t)[0]).all() for d, t in zip(dec, aw))
        sym = np.concatenate([_sym(t)[0] for t in aw], axis=1)
        bits = np.concatenate([_sym(t)[1] for t in aw], axis=1)
        one = rans.encode_streams(sym, bits, 256 * sym.shape[1], compact_models=compact)
        tb, d1 = best(lambda: rans.decode_streams(one, bits, 256 * sym.shape[1]))
        assert (d1 == sym).all()
        res[name] = {"encode_per_tensor_s": te, "decode_many_s": td, "decode_one_buffer_s": tb,
                     "decode_many_Msym_s": res["symbols"] / td / 1e6, "bytes": sum(len(b[0]) for b in bufs)}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "experiments" / "results"))
    ap.add_argument("--cache", default=str(ROOT / "bench" / ".cache"))
    a = ap.parse_args(argv)
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~/.cache"), "jaxguard", "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    torch.set_num_threads(1)
    import reproduce
    import torch_compat
    from entropy_probe import tensor_streams
    from torch_compat import models
    t_run, load0 = time.perf_counter(), os.getloadavg()
    cache = Path(a.cache)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, seed, steps, frac in CKPTS:
            ck = reproduce.checkpoints(kind, seed, steps, cache)[0][frac]
            label = f"{kind} seed{seed} {steps} steps @{frac:.0%}"
            data_aw, s = torch_compat.compress_checkpoint(ck, tau=TAU, clip=CLIP, codec="logrel-aw")
            r = recode(tensor_streams(data_aw))
            r.update(checkpoint=label, coordinates=s["coordinates"], escapes=s["escapes"],
                     **audit_and_compare(label, kind, ck, data_aw, tmp))
            rows.append(r)
            print(json.dumps(r), flush=True)
    demo_path = cache / "demo-transformer-seed0-steps150.pt"
    if demo_path.exists():
        demo = torch.load(demo_path, weights_only=False)
    else:
        demo, _, _ = models.train("transformer", seed=0, steps=150, fractions=(1.0,))
        cache.mkdir(parents=True, exist_ok=True)
        torch.save(demo, demo_path)
    data_demo, _ = torch_compat.compress_checkpoint(demo[1.0], tau=TAU, clip=CLIP, codec="logrel-aw")
    sp = speed(tensor_streams(data_demo))
    print(json.dumps(sp), flush=True)
    res = {"rows": rows, "speed": sp, "machine": reproduce.machine_info(), "loadavg_start": load0,
           "loadavg_end": os.getloadavg(), "seconds": time.perf_counter() - t_run, "tau": TAU, "clip": CLIP,
           "command": "nice python bench/experiments/compact_models.py"}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compact_models.json").write_text(json.dumps(res, indent=1))
    write_md(out / "compact_models.md", res)


def write_md(path, res):
    L = ["# Compact rANS models on logrel-ans (bench/experiments/compact_models.py)", "",
         f"Command: `{res['command']}`.  tau = {res['tau']}, C = {res['clip']}; moments payload % of FP32.  "
         "before = kind-1 models (4-bit level per symbol; main's writer rule), after = the smaller of kind 3 "
         "(compact) and kind 1 per tensor (this writer; `writer` = the payload of the real "
         "`compress_checkpoint(codec=\"logrel-ans\")`), each tensor keeping the packed form where smaller.  "
         f"Machine: {res['machine']['platform']}, {res['machine']['cpu_count']} CPUs shared with other jobs "
         f"(load average {res['loadavg_start'][0]:.1f} at start, {res['loadavg_end'][0]:.1f} at end).", "",
         "| checkpoint | coords | escapes | before % | after % | writer % | entropy floor % | model B before | "
         "model B after | tensors rANS before | after (compact/kind 1) | m\\|v context saving (points, tensors) | "
         "audit max gap / lr | over tau | decoded = logrel-aw |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        L.append(f"| {r['checkpoint']} | {r['coordinates']:,} | {r['escapes']} | {r['pct_before']:.2f} | "
                 f"{r['pct_after']:.2f} | {100 * r['writer_payload_ratio']:.2f} | {r['pct_floor']:.2f} | "
                 f"{r['model_bytes_before']} | {r['model_bytes_after']} | {r['rans_before']}/{r['tensors']} | "
                 f"{r['rans_after']}/{r['tensors']} ({r['compact_chosen']}/{r['inline_chosen']}) | "
                 f"{r['pct_ctx_saving']:.3f} ({r['ctx_tensors']}) | {r['max_gap_lr']:.4f} | {r['violations']} | "
                 f"{r['decoded_equal_to_aw']} |")
    sp = res["speed"]
    L += ["", f"## Speed (demo codes: {sp['symbols']:,} symbols in {sp['tensors']} per-tensor buffers; best of 3; "
          "numpy, loaded 2-core machine)", "",
          "| models | encode (all tensors, fit included) s | decode_many s | decode_many M symbols/s | "
          "one buffer of all lanes: decode s | bytes |", "|---|---|---|---|---|---|"]
    for k in ("kind1", "kind3"):
        s = sp[k]
        L.append(f"| {k} | {s['encode_per_tensor_s']:.3f} | {s['decode_many_s']:.3f} | {s['decode_many_Msym_s']:.2f} | "
                 f"{s['decode_one_buffer_s']:.3f} | {s['bytes']:,} |")
    L += ["", f"Run took {res['seconds']:.0f} s.", ""]
    path.write_text("\n".join(L))


if __name__ == "__main__":
    main()
