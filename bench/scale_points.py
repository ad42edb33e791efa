"""The cost from 16.5M to 124M to 774M coordinates: the whole-process figures of three
`bench/codec_speed.py` runs side by side, and the slope of each (least squares, nanoseconds
a coordinate).

    python bench/codec_speed.py --sweep ""
    python bench/codec_speed.py --gpt2 --sweep ""
    python bench/codec_speed.py --gpt2-large --sweep "" --repeats 2
    python bench/scale_points.py bench/results/codec_speed_16m.json bench/results/codec_speed_gpt2.json \\
        bench/results/codec_speed_gpt2_large.json [--out bench/results/scale_points]

Writes Markdown and JSON next to --out.

A 774M repeat (plain, compress, restore) takes minutes and ~9 GB; on a shared machine each
one can run as its own `codec_speed.py --repeats 1` process (the first with the cold compress,
the others with ``--no-cold`` and the same ``XDG_CACHE_HOME``), and ``--merge`` then joins them
into the one result those runs would have made with ``--repeats N``:

    python bench/scale_points.py --merge R1.json R2.json R3.json --merged bench/results/codec_speed_gpt2_large
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES = ("plain", "compress", "restore")


def point(path):
    """One run's medians: coordinates, bytes, seconds and peak RSS of each process."""
    with open(path) as fh:
        res = json.load(fh)
    w = res["whole_process"]
    s = w["summary"]
    out = {"run": os.path.basename(path), "model": res.get("model"), "commit": res.get("commit"),
           "coordinates": s["coordinates"],
           "source_bytes": s["source_bytes"], "container_bytes": s["container_bytes"],
           "payload_ratio": s["payload_ratio"], "escape_rate": s["escape_rate"], "repeats": res["repeats"],
           "machine": res["machine"]}
    for p in PROCESSES:
        out[p] = {"seconds": w["median"][p]["seconds"], "peak_rss": w["median"][p]["peak_rss"]}
    out["ratios"] = {k: w["ratios"][k] for k in ("compress_time", "restore_time", "compress_rss", "restore_rss")}
    return out


def merge_repeats(paths, note=""):
    """One `codec_speed.py` result from several runs of one repeat each on the same checkpoint:
    their timed processes pooled, medians and ratios taken again over the pool (ratios of
    medians, as `codec_speed.whole_process` takes them), the cold compress and compile probe
    from the run that made them."""
    runs = []
    for p in paths:
        with open(p) as fh:
            runs.append(json.load(fh))
    res = runs[0]
    w = res["whole_process"]
    keys = list(w["median"])
    if not set(keys) <= {"plain", "plain_fsync", "compress", "restore"}:
        raise SystemExit(f"--merge joins plain, plain_fsync, compress and restore runs only, not {keys}")
    for p, r in zip(paths[1:], runs[1:]):
        rw = r["whole_process"]
        if rw["summary"]["coordinates"] != w["summary"]["coordinates"] or list(rw["median"]) != keys:
            raise SystemExit(f"--merge: {p} timed other processes or another checkpoint than {paths[0]}")
        if w.get("cold_compress") is None and rw.get("cold_compress") is not None:
            w["cold_compress"], w["second_run"] = rw["cold_compress"], rw["second_run"]
    for k in keys:
        w[k] = [x for r in runs for x in r["whole_process"][k]]
    w["per_repeat_time_ratios"] = [x for r in runs for x in r["whole_process"]["per_repeat_time_ratios"]]
    w["median"] = {k: {f: statistics.median(x[f] for x in w[k]) for f in ("seconds", "peak_rss")} for k in keys}
    med = w["median"]
    w["ratios"] = {f"{k}_{q}": med[k][f] / med["plain"][f] for k in keys if k != "plain"
                   for q, f in (("time", "seconds"), ("rss", "peak_rss"))}
    if "plain_fsync" in med:
        w["ratios"].update(compress_vs_durable_plain=med["compress"]["seconds"] / med["plain_fsync"]["seconds"],
                           restore_vs_durable_plain=med["restore"]["seconds"] / med["plain_fsync"]["seconds"])
    res["repeats"] = sum(r["repeats"] for r in runs)
    res["merged_from"] = [{"commit": r["commit"], "load_at_start": r.get("load_at_start"),
                           "loadavg_at_end": r["machine"].get("loadavg_at_end")} for r in runs]
    res["machine"]["loadavg_at_end"] = runs[-1]["machine"].get("loadavg_at_end")
    res["machine"]["note"] = (note + "; " if note else "") + (
        f"{len(runs)} processes of one repeat each, each alone on the machine, pooled; " + res["machine"]["note"])
    return res


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
             "each run took the machine alone). Whole processes, medians of interleaved runs; the ratios are "
             "ratios of those medians. plain = `torch.save(torch.load(src))`.", "",
             "| checkpoint | coordinates | source | container | payload / FP32 | plain | compress | x plain | "
             "restore | x plain | peak RSS compress / plain | restore / plain |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        r = p["ratios"]
        lines.append(f"| {p['model']} ({p['run']}, {p['repeats']} repeats) | {p['coordinates']:,} | {p['source_bytes'] / gib:.2f} GiB | "
                     f"{p['container_bytes'] / gib:.2f} GiB | {100 * p['payload_ratio']:.2f}% | "
                     f"{p['plain']['seconds']:.2f} s | {p['compress']['seconds']:.2f} s | **{r['compress_time']:.2f}x** | "
                     f"{p['restore']['seconds']:.2f} s | **{r['restore_time']:.2f}x** | {r['compress_rss']:.2f}x | "
                     f"{r['restore_rss']:.2f}x |")
    lines += ["", "Least-squares fit over the three points, seconds = intercept + slope x coordinates:", "",
              "| process | slope | intercept |", "|---|---:|---:|"]
    for proc in PROCESSES:
        f = fit[proc]
        lines.append(f"| {proc} | {f['ns_per_coordinate']:.1f} ns a coordinate | {f['intercept_s']:.2f} s |")
    lines += ["", "At the margin a coordinate costs the compress "
              f"{fit['compress']['ns_per_coordinate'] / fit['plain']['ns_per_coordinate']:.2f}x and the restore "
              f"{fit['restore']['ns_per_coordinate'] / fit['plain']['ns_per_coordinate']:.2f}x what it costs the "
              "plain save (the slopes' ratios)."]
    lines += ["", "Commits: " + ", ".join(f"{p['run']} {str(p['commit'])[:7]}" for p in points), ""]
    with open(path, "w") as fh:
        fh.write("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="codec_speed JSON results, smallest first")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "scale_points"))
    ap.add_argument("--merge", action="store_true", help="join RUNS (one checkpoint, one repeat each) into one "
                                                         "codec_speed result at --merged instead")
    ap.add_argument("--merged", default=os.path.join(ROOT, "bench", "results", "codec_speed_gpt2_large"),
                    help="path prefix of the joined codec_speed result (JSON, Markdown, PNG)")
    ap.add_argument("--note", default="", help="what else ran on the machine (written into the joined result)")
    a = ap.parse_args(argv)
    if a.merge:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        import codec_speed
        res = merge_repeats(a.runs, a.note)
        with open(a.merged + ".json", "w") as fh:
            json.dump(res, fh, indent=1)
        codec_speed.plot(res, a.merged + ".png")
        codec_speed.write_md(res, a.merged + ".md")
        print(f"wrote {a.merged}.md")
        return
    points = sorted((point(p) for p in a.runs), key=lambda p: p["coordinates"])
    fit = slopes(points)
    with open(a.out + ".json", "w") as fh:
        json.dump({"points": points, "fit": fit}, fh, indent=1)
    write_md(points, fit, a.out + ".md")
    print(f"wrote {a.out}.md")


if __name__ == "__main__":
    main()
