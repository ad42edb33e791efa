"""The cost from 16.5M to 124M to 774M coordinates: the whole-process figures of three
`bench/codec_speed.py` runs side by side, and the slope of each (least squares, nanoseconds
a coordinate).

    python bench/codec_speed.py --sweep ""
    python bench/codec_speed.py --gpt2 --sweep ""
    python bench/codec_speed.py --gpt2-large --sweep "" --repeats 2
    python bench/scale_points.py bench/results/codec_speed_16m.json bench/results/codec_speed_gpt2.json \\
        bench/results/codec_speed_gpt2_large.json [--out bench/results/scale_points]

Writes Markdown and JSON next to --out.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES = ("plain", "compress", "restore")


def point(path):
    """One run's medians: coordinates, bytes, seconds and peak RSS of each process."""
    with open(path) as fh:
        res = json.load(fh)
    w = res["whole_process"]
    s = w["summary"]
    out = {"run": os.path.basename(path), "commit": res.get("commit"), "coordinates": s["coordinates"],
           "source_bytes": s["source_bytes"], "container_bytes": s["container_bytes"],
           "payload_ratio": s["payload_ratio"], "escape_rate": s["escape_rate"], "repeats": res["repeats"],
           "machine": res["machine"]}
    for p in PROCESSES:
        out[p] = {"seconds": w["median"][p]["seconds"], "peak_rss": w["median"][p]["peak_rss"]}
    out["ratios"] = {k: w["ratios"][k] for k in ("compress_time", "restore_time", "compress_rss", "restore_rss")}
    return out


def slopes(points):
    """Least-squares seconds = a + b * coordinates for each process: (a s, b ns/coordinate)."""
    n = np.array([p["coordinates"] for p in points], float)
    out = {}
    for proc in PROCESSES:
        t = np.array([p[proc]["seconds"] for p in points], float)
        b, a = np.polyfit(n, t, 1)
        out[proc] = {"intercept_s": float(a), "ns_per_coordinate": float(b * 1e9)}
    return out


def write_md(points, fit, path):
    gib = 2.0 ** 30
    lines = ["# The cost from 16.5M to 774M coordinates (`python bench/scale_points.py`)", "",
             f"Machine: {points[0]['machine'].get('processor')}, {points[0]['machine'].get('cpus')} cores (shared; "
             "each run took the machine alone). Whole processes, medians; the ratios are medians of side-by-side "
             "pairs. plain = `torch.save(torch.load(src))`.", "",
             "| checkpoint | coordinates | source | container | payload / FP32 | plain | compress | x plain | "
             "restore | x plain | peak RSS compress / plain | restore / plain |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        r = p["ratios"]
        lines.append(f"| {p['run']} | {p['coordinates']:,} | {p['source_bytes'] / gib:.2f} GiB | "
                     f"{p['container_bytes'] / gib:.2f} GiB | {100 * p['payload_ratio']:.2f}% | "
                     f"{p['plain']['seconds']:.2f} s | {p['compress']['seconds']:.2f} s | **{r['compress_time']:.2f}x** | "
                     f"{p['restore']['seconds']:.2f} s | **{r['restore_time']:.2f}x** | {r['compress_rss']:.2f}x | "
                     f"{r['restore_rss']:.2f}x |")
    lines += ["", "Least-squares fit over the three points, seconds = intercept + slope x coordinates:", "",
              "| process | slope | intercept |", "|---|---:|---:|"]
    for proc in PROCESSES:
        f = fit[proc]
        lines.append(f"| {proc} | {f['ns_per_coordinate']:.1f} ns a coordinate | {f['intercept_s']:.2f} s |")
    lines += ["", "Commits: " + ", ".join(f"{p['run']} {str(p['commit'])[:7]}" for p in points), ""]
    with open(path, "w") as fh:
        fh.write("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="codec_speed JSON results, smallest first")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "scale_points"))
    a = ap.parse_args(argv)
    points = sorted((point(p) for p in a.runs), key=lambda p: p["coordinates"])
    fit = slopes(points)
    with open(a.out + ".json", "w") as fh:
        json.dump({"points": points, "fit": fit}, fh, indent=1)
    write_md(points, fit, a.out + ".md")
    print(f"wrote {a.out}.md")


if __name__ == "__main__":
    main()
