"""Per-checkpoint payload table of a reproduction run (issue 17): one row per checkpoint
(model, seed, fraction) and per optax checkpoint, one column per codec (payload % of FP32,
escapes, coordinates over tau in the real torch / jitted optax audit), and the target
(<= 23% at tau = 0.01) checked per checkpoint.

    python bench/logrel_ans_table.py [bench/results/logrel_ans_reproduction] [--target 0.23]
    python bench/logrel_ans_table.py bench/results/log8_rel_zstd_reproduction --target 0.245

Reads <dir>/guarded_reproduction.json (bench/reproduce.py --codecs log8-rel,CODEC
--out <dir>); writes <dir>/per_checkpoint.md; the target applies to the last codec.
"""
import json
import sys
from pathlib import Path

TARGET = 0.23


def main(argv):
    target = TARGET
    if "--target" in argv:
        at = argv.index("--target")
        target = float(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    d = Path(argv[0] if argv else "bench/results/logrel_ans_reproduction")
    res = json.loads((d / "guarded_reproduction.json").read_text())
    codecs = res["settings"]["codecs"]
    rows = [dict(r, audit="torch.optim.Adam") for r in res["rows"]]
    rows += [dict(r, audit="jitted optax.adam") for r in (res.get("optax_rows") or [])]
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["seed"], r["fraction"], r["step"], r["audit"]), {})[r["codec"]] = r
    L = ["# Payload per checkpoint (bench/reproduce.py " + f"--codecs {','.join(codecs)}; tau 0.01, C 0.2)", "",
         f"Commands: `python bench/reproduce.py --codecs {','.join(codecs)} --no-ablation --continue-steps 0 "
         f"--fresh --out {d}` then `python bench/logrel_ans_table.py {d} --target {target}` (continuation skipped: the payload and the audit do not need it; "
         "--fresh: every condition recomputed by this commit's code, older rows in the runs.jsonl unused).", "",
         f"{len(by)} checkpoints; cells: payload % of FP32 / escapes / coordinates over tau in the audit "
         "(torch: real next-batch gradient + gradient grid; optax: gradient grid + one random draw).", "",
         "| model | seed | ckpt (step) | audit | " + " | ".join(codecs) + f" | {codecs[-1]} <= {100 * target:g}% |",
         "|---|---|---|---|" + "---|" * (len(codecs) + 1)]
    met, over = 0, 0
    for (m, s, f, step, audit), cs in by.items():
        cells = []
        for c in codecs:
            r = cs.get(c)
            if r is None:
                cells.append("-")
                continue
            over += r["audit_violations"]
            cells.append(f"{100 * r['payload_ratio']:.2f} / {r['escapes']} / {r['audit_violations']}")
        ok = codecs[-1] in cs and cs[codecs[-1]]["payload_ratio"] <= target
        met += ok
        L.append(f"| {m} | {s} | {int(100 * f)}% ({step}) | {audit} | " + " | ".join(cells) + f" | {'yes' if ok else 'no'} |")
    L += ["", f"Target <= {100 * target:g}% met on {met} of {len(by)} checkpoints; coordinates over tau in all rows: {over}.", ""]
    base = codecs[0]
    for c in codecs:
        rs = [cs[c] for cs in by.values() if c in cs]
        if not rs:
            continue
        p = [100 * r["payload_ratio"] for r in rs]
        line = f"* {c}: payload {min(p):.2f}-{max(p):.2f}% of FP32 over {len(rs)} checkpoints"
        tr = [(cs[c]["restore_seconds"], cs[base]["restore_seconds"]) for cs in by.values()
              if c in cs and base in cs and cs[c].get("restore_seconds") and cs[base].get("restore_seconds")]
        if tr and c != base:
            ratio = sorted(a / b for a, b in tr)
            line += (f"; restore / {base} restore (same process, median of 3 each): median "
                     f"{ratio[len(ratio) // 2]:.2f}x, range {ratio[0]:.2f}-{ratio[-1]:.2f}x")
        L.append(line + ".")
    (d / "per_checkpoint.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main(sys.argv[1:])
