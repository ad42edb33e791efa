"""logrel-ans's frontier: payload against compress and restore time, whole processes side by
side with log8-rel, for several efforts of the rate pass (`jaxguard.core.rate.ROUNDS`), and
what zstd would store over the same codes instead of the rANS streams.

    python bench/logrel_ans_frontier.py run --src CKPT.pt [--rounds 4,2,1,0] [--repeats 1] \
        [--work DIR] [--json bench/results/logrel_ans_frontier.json]    (a point R:inner: R rounds, one-step moves only)
    python bench/logrel_ans_frontier.py plot [--json ...] [--out bench/results/logrel_ans_frontier]

``run`` times, per repeat and interleaved, ``jaxguard compress --codec log8-rel`` and its
restore, then ``jaxguard compress --codec logrel-ans`` with ``rate.ROUNDS`` set to each value
(``python -c``: the library is unchanged, only the pass's round limit) and its restore, each
a fresh process (`codec_speed.run_child`: wall seconds and peak RSS).  It appends the
repeats to the JSON file (so a long series can be split over several calls) and records,
per point, the container's payload and, untimed, the zstd estimate: each ``mv_rans``
section replaced by zstd (level 3, `jaxguard.format.entropy.LEVEL`) frames of the same
codes (m and v fields as one byte each, or two for a block wider than 8 bits, and the
block's m scale, which rANS keeps in its lane tails).  ``plot`` writes the figure and a
markdown table of the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from codec_speed import _json_summary, run_child  # noqa: E402

DEFAULT_JSON = os.path.join(HERE, "results", "logrel_ans_frontier.json")
# argv[1]: ROUNDS, or ROUNDS:inner (the candidates one step away only: rate.INNER of them)
COMPRESS_WITH_ROUNDS = ("import sys; from jaxguard.core import rate; r, _, ring = sys.argv[1].partition(':'); "
                        "rate.ROUNDS = int(r)\n"
                        "if ring == 'inner':\n"
                        "    rate._CANDIDATES, rate.INNER_OF, rate.OUTER_ROW = (rate._CANDIDATES[:rate.INNER], "
                        "rate.INNER_OF[:rate.INNER], rate.OUTER_ROW[:rate.INNER])\n"
                        "from jaxguard.cli.main import main; sys.exit(main(sys.argv[2:]))")


def zstd_estimate(container):
    """(payload bytes as stored, rANS section bytes, zstd bytes of the same codes) of a container."""
    import numpy as np
    import zstandard

    from jaxguard.format import entropy, reader
    with open(container, "rb") as fh:
        header, payload = reader.parse(fh.read())[:2]
    entries = header["entries"]
    symbols = reader.decode_rans_entries(entries, payload)
    cctx = zstandard.ZstdCompressor(level=entropy.LEVEL)
    rans_bytes = zstd_bytes = 0
    for k, entry in enumerate(entries):
        s = entry.get("sections")
        if entry.get("kind") != "moments" or not isinstance(s, dict) or "mv_rans" not in s:
            continue
        b, e = s["mv_rans"]
        rans_bytes += e - b
        n = reader.shape_size(entry)[1]
        if k in symbols:
            (codes, tails) = symbols[k]
        else:
            nb = max(1, -(-n // 256))
            codes, tails = reader.rans.decode_streams(*reader._rans_item(entry["name"], s, payload, n, nb),
                                                      lane_tails=True)
        for stream in codes:
            flat = np.asarray(stream).reshape(-1)[:n]
            parts = [flat.astype(np.uint8)] + ([(flat >> 8).astype(np.uint8)] if flat.max(initial=0) > 255 else [])
            zstd_bytes += sum(len(cctx.compress(p.tobytes())) for p in parts)
        zstd_bytes += len(cctx.compress(np.asarray(tails, "<u2").tobytes()))
    return len(payload), rans_bytes, zstd_bytes


def run(args):
    work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="ans_frontier_"))
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT)
    py = sys.executable
    src = os.path.abspath(args.src)
    points = [("log8-rel", None)] + [("logrel-ans", r) for r in args.rounds.split(",")]
    res = json.load(open(args.json)) if os.path.exists(args.json) else {"src": src, "points": {}}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    res.setdefault("commits", [])
    if commit not in res["commits"]:
        res["commits"].append(commit)
    res["load_before"] = res.get("load_before", []) + [os.getloadavg()]
    for rep in range(args.repeats):
        for codec, rounds in points:
            name = codec if rounds is None else f"{codec} rounds={rounds}"
            out = os.path.join(work, name.replace(" ", "_").replace("=", "").replace(":", "_") + ".jg")
            argv = ["compress", src, "-o", out, "--json", "--codec", codec]
            cmd = [py, "-m", "jaxguard", *argv] if rounds is None else [py, "-c", COMPRESS_WITH_ROUNDS, str(rounds), *argv]
            os.sync()
            cw, crss, text, _ = run_child(cmd, env, cwd=ROOT)
            summary = _json_summary(text)
            os.sync()
            rw, rrss, _, _ = run_child([py, "-m", "jaxguard", "restore", out, "-o", out + ".pt"], env, cwd=ROOT)
            p = res["points"].setdefault(name, {"codec": codec, "rounds": rounds, "compress_s": [], "restore_s": [],
                                                "compress_rss": [], "restore_rss": []})
            p["compress_s"].append(cw)
            p["restore_s"].append(rw)
            p["compress_rss"].append(crss)
            p["restore_rss"].append(rrss)
            p["payload_ratio"] = summary["payload_bytes"] / summary["raw_fp32_bytes"]
            p["raw_fp32_bytes"] = summary["raw_fp32_bytes"]
            p["escapes"] = summary.get("escapes")
            if codec == "logrel-ans" and "zstd_payload_ratio" not in p:
                stored, rans_b, zstd_b = zstd_estimate(out)
                p["zstd_payload_ratio"] = (summary["payload_bytes"] - rans_b + zstd_b) / summary["raw_fp32_bytes"]
            print(f"repeat {rep} {name}: compress {cw:.2f} s, restore {rw:.2f} s, payload "
                  f"{100 * p['payload_ratio']:.3f}%" + (f", zstd instead of rANS {100 * p['zstd_payload_ratio']:.3f}%"
                                                       if "zstd_payload_ratio" in p else ""), flush=True)
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1)
    res["load_after"] = res.get("load_after", []) + [os.getloadavg()]
    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=1)


def plot(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = json.load(open(args.json))
    base = res["points"]["log8-rel"]
    bc, br = statistics.median(base["compress_s"]), statistics.median(base["restore_s"])
    rows = []
    for name, p in res["points"].items():
        c, r = statistics.median(p["compress_s"]), statistics.median(p["restore_s"])
        rows.append((name, p, c, r, c / bc, r / br))
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for name, p, c, r, xc, xr in rows:
        for k, (x, what) in enumerate(((xc, "compress"), (xr, "restore"))):
            ax[k].scatter([x], [100 * p["payload_ratio"]], label=name)
            ax[k].annotate(name.replace("logrel-ans ", ""), (x, 100 * p["payload_ratio"]), fontsize=7)
            if "zstd_payload_ratio" in p:
                ax[k].scatter([x], [100 * p["zstd_payload_ratio"]], marker="x", color="grey")
    for k, what, target in ((0, "compress", 4.0), (1, "restore", 1.2)):
        ax[k].axvline(target, ls="--", color="red", lw=0.8)
        ax[k].axhline(21.5, ls=":", color="red", lw=0.8)
        ax[k].set_xlabel(f"{what} time / log8-rel's (whole processes, medians)")
        ax[k].set_ylabel("payload, % of FP32")
        ax[k].set_xscale("log")
    ax[0].set_title("grey x: zstd over the same codes (payload estimated, drawn at the rANS point's time)", fontsize=8)
    fig.suptitle(f"logrel-ans frontier, {base['raw_fp32_bytes'] // 8:,} Adam coordinates (2-core shared box)")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    lines = [f"# logrel-ans frontier: payload against compress and restore time ({base['raw_fp32_bytes'] // 8:,} "
             "Adam coordinates)", "",
             f"`python bench/logrel_ans_frontier.py run --src {res['src']} --rounds ...` (repeats appended over "
             f"several calls), then `python bench/logrel_ans_frontier.py plot`. Commits: {', '.join(c[:7] for c in res['commits'])}. "
             "Machine: AMD EPYC, 2 cores, shared with other engineers' jobs (each call ran under the box's "
             "exclusive timing lock; load averages at the start of each call: "
             f"{', '.join('%.2f' % la[0] for la in res['load_before'])}). Whole processes, interleaved per repeat; "
             "`rounds` is `jaxguard.core.rate.ROUNDS` (the rate pass's rounds; 0: no pass, the width search's codes; `R:inner`: "
             "R rounds over the 8 moves one step away only, not all 24).", "",
             "| point | repeats | compress s | x log8-rel | restore s | x log8-rel | peak RSS compress MiB | payload % FP32 "
             "| zstd over the same codes % FP32 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p, c, r, xc, xr in rows:
        z = f"{100 * p['zstd_payload_ratio']:.3f}" if "zstd_payload_ratio" in p else ""
        lines.append(f"| {name} | {len(p['compress_s'])} | {c:.2f} | {xc:.2f} | {r:.2f} | {xr:.2f} | "
                     f"{max(p['compress_rss']) / 2**20:.0f} | {100 * p['payload_ratio']:.3f} | {z} |")
    lines += ["", "Targets (issue 57): compress <= 4x and restore <= 1.2x log8-rel's, payload <= 21.5% of FP32.", ""]
    with open(args.out + ".md", "w") as fh:
        fh.write("\n".join(lines) + ("\n" + args.note if args.note else "") + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--src", required=True)
    r.add_argument("--rounds", default="4,2,1,0")
    r.add_argument("--repeats", type=int, default=1)
    r.add_argument("--work")
    r.add_argument("--json", default=DEFAULT_JSON)
    p = sub.add_parser("plot")
    p.add_argument("--json", default=DEFAULT_JSON)
    p.add_argument("--out", default=os.path.join(HERE, "results", "logrel_ans_frontier"))
    p.add_argument("--note", help="a markdown paragraph appended to the table")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else plot(args)


if __name__ == "__main__":
    main()
