"""Encode / restore throughput of the guarded codecs next to torch.save / torch.load of
the same checkpoint, measured side by side in one run.

    python bench/codec_speed.py [--steps 60] [--repeats 5] [--out bench/results/codec_speed]

A ByteTransformer (d=128, 4 layers, ~0.9M parameters) is trained for --steps Adam steps
on the standard library's source text; its checkpoint is then compressed with every
codec (warm: one untimed run first, so XLA compilation is excluded), restored, and
saved/loaded with torch. Medians over --repeats. Writes JSON and a Markdown table.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "codec_speed"))
    a = ap.parse_args(argv)

    import jax

    import torch_compat
    from jaxguard import _demo, guard
    from jaxguard.container import atomic_write

    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny model on shared cores (see jaxguard/_demo.py)
    model = _demo.ByteTransformer(d=128, layers=4, heads=4, ctx=64)
    sample = _demo.text_batches(0)
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3, foreach=False)
    for _ in range(a.steps):
        opt.zero_grad()
        _demo.loss_fn(model, sample(True)).backward()
        opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    coords = sum(st["exp_avg"].numel() for st in ckpt["optimizer"]["state"].values())

    def med(f):
        f()  # warm-up (compiles)
        ts = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pt = os.path.join(tmp, "c.pt")
        save_s = med(lambda: torch.save(ckpt, pt))
        load_s = med(lambda: torch.load(pt, weights_only=True))
        torch_bytes = os.path.getsize(pt)
        for codec in guard.CODECS:
            path = os.path.join(tmp, f"{codec}.jg")
            out = {}

            def enc():
                data, s = torch_compat.compress_checkpoint(ckpt, codec=codec)
                atomic_write(path, data)
                out["s"] = s
            enc_s = med(enc)
            res_s = med(lambda: torch_compat.restore_tree(path))
            s = out["s"]
            rows.append({"codec": codec, "coordinates": coords, "escapes": s["escapes"],
                         "payload_ratio": s["payload_ratio"], "container_bytes": s["container_bytes"],
                         "torch_save_bytes": torch_bytes, "encode_seconds": enc_s, "restore_seconds": res_s,
                         "torch_save_seconds": save_s, "torch_load_seconds": load_s,
                         "encode_vs_save": enc_s / save_s, "restore_vs_load": res_s / load_s,
                         "encode_coords_per_s": coords / enc_s})
            print(f"{codec:>18}: encode {enc_s:.3f} s ({enc_s / save_s:.1f}x torch.save), restore {res_s:.3f} s "
                  f"({res_s / load_s:.1f}x torch.load), payload {100 * s['payload_ratio']:.2f}%", flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    result = {"machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                          "note": "2 shared cores; other jobs may run"},
              "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "jax": jax.__version__},
              "commit": commit, "steps": a.steps, "repeats": a.repeats, "rows": rows}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as fh:
        json.dump(result, fh, indent=1)
    with open(a.out + ".md", "w") as fh:
        fh.write(f"# Codec speed ({coords:,} Adam coordinates, ByteTransformer d=128 x4, {a.steps} steps)\n\n"
                 f"Medians of {a.repeats} warm runs; torch.save {save_s * 1e3:.1f} ms, torch.load {load_s * 1e3:.1f} ms "
                 f"of the same checkpoint ({torch_bytes:,} bytes). Machine: {platform.processor() or platform.machine()}, "
                 f"{os.cpu_count()} cores.\n\n| codec | escapes | payload/FP32 | encode s | x save | restore s | x load |\n"
                 "|---|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            fh.write(f"| {r['codec']} | {r['escapes']:,} | {100 * r['payload_ratio']:.2f}% | {r['encode_seconds']:.3f} | "
                     f"{r['encode_vs_save']:.1f} | {r['restore_seconds']:.3f} | {r['restore_vs_load']:.1f} |\n")


if __name__ == "__main__":
    main()
