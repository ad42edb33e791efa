"""Where the bytes of a log8-rel-zstd entry go on the small reproduction checkpoints, and
which lossless transforms of its sections gain there (issue 57, item 1).

    python bench/experiments/zstd_small_payload.py collect [--cache bench/.cache]
    python bench/experiments/zstd_small_payload.py analyse [--out bench/experiments/results/zstd_small_payload.md]

``collect`` builds the reproduction checkpoints as bench/reproduce.py does (its trained
CNN and transformer checkpoints under ``--cache``; the optax MLP trained by its
``run_optax``, the real ``jaxguard.save``), writes each with the default codec
(log8-rel-zstd, tau 0.01, C 0.2) and keeps, per entry, the stored size of every section
and its decoded bytes (bench/.cache/zstd_small_payload.pkl, gitignored).

``analyse`` measures, on those decoded bytes, the payload each transform would store
(every zstd figure is a real zstd frame, decoded back and compared; entropies are floors,
not stored sizes).  Dictionaries and static models are trained on half of a model's seeds
and measured on the other half (held out), and with the halves swapped; one dictionary line is
trained on the other two models.  The transformer (two seeds) is the control.
"""
from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CODEC = "log8-rel-zstd"
PICKLE = "zstd_small_payload.pkl"


# ---------------------------------------------------------------- collect
def _entries(data: bytes):
    """[(name, n, {section: stored bytes}, {section: decoded bytes})] of a container's moments entries."""
    from jaxguard.format import entropy, reader
    header, payload = reader.parse(data)
    pay = bytes(payload)
    out = []
    for e in header["entries"]:
        if e.get("kind") != "moments":
            continue
        n = int(np.prod(e["shape"])) if e["shape"] else 1
        sizes, decoded = {}, {}
        for key, (b, end) in e["sections"].items():
            sizes[key] = end - b
            raw = pay[b:end]
            decoded[key] = raw if key == "escape_pairs" else bytes(entropy.decode_stream(raw, key))
        out.append((e["name"], n, sizes, decoded))
    return out


def collect(cache: Path):
    import reproduce
    import torch_compat
    import jaxguard

    ckpts = []
    for kind, seeds, steps in (("cnn", reproduce.SEEDS["cnn"], 300), ("transformer", (701, 707), 400)):
        for seed in seeds:
            by_fraction, _ = reproduce.checkpoints(kind, seed, steps, cache)
            for f in reproduce.FRACTIONS:
                data, _ = torch_compat.compress_checkpoint(by_fraction[f], tau=reproduce.TAU, clip=reproduce.CLIP,
                                                           codec=CODEC)
                ckpts.append({"model": kind, "seed": seed, "fraction": f, "entries": _entries(bytes(data))})
                print(kind, seed, f, flush=True)
    real_save = jaxguard.save
    current = {}

    def save_and_keep(path, *args, **kw):       # the real save; its file kept for the analysis
        s = real_save(path, *args, **kw)
        with open(path, "rb") as fh:
            current.setdefault("files", []).append(fh.read())
        return s

    jaxguard.save = save_and_keep
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for seed in (701, 702, 703, 704):
                current["files"] = []
                reproduce.run_optax([seed], 300, [CODEC], 0, tmp)
                for f, data in zip(reproduce.FRACTIONS, current["files"]):
                    ckpts.append({"model": "mlp-optax", "seed": seed, "fraction": f, "entries": _entries(data)})
                    print("mlp-optax", seed, f, flush=True)
    finally:
        jaxguard.save = real_save
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / PICKLE, "wb") as fh:
        pickle.dump(ckpts, fh)


# ---------------------------------------------------------------- analyse
TARGET = 24.5
MODELS = ("cnn", "mlp-optax", "transformer")
STREAMS = ("m_codes", "v_codes", "params", "escape_index", "widths", "m_high", "v_high")


def _zstd(level, dictionary=None):
    import zstandard as zs
    params = zs.ZstdCompressionParameters.from_level(level, format=zs.FORMAT_ZSTD1_MAGICLESS, write_content_size=True,
                                                     write_checksum=False, write_dict_id=False)
    return (zs.ZstdCompressor(compression_params=params, dict_data=dictionary),
            zs.ZstdDecompressor(format=zs.FORMAT_ZSTD1_MAGICLESS, dict_data=dictionary))


def stream_bytes(data: bytes, level=1, dictionary=None) -> int:
    """Stored bytes of one stream (docs/format.md's framing: varint D, varint S, the frame
    as zstd or as is), with a real zstd frame decoded back and compared."""
    from jaxguard.format.zstd_streams import _varint
    if not data:
        return 1
    c, d = _zstd(level, dictionary)
    z = c.compress(data)
    if d.decompress(z, max_output_size=len(data)) != data:
        raise AssertionError("zstd did not give the bytes back")
    return len(_varint(len(data))) + len(_varint(min(len(z), len(data)))) + min(len(z), len(data))


def header_bytes(data: bytes, stored: int) -> int:
    """The varint header bytes of a stored stream (the rest is its frame)."""
    from jaxguard.format.zstd_streams import _varint
    rest = stored - len(_varint(len(data)))           # = S + len(varint(S)) for a one-frame stream
    return stored - rest + (next(k for k in range(1, 8) if len(_varint(rest - k)) == k) if data else 0)


def v_delta(data: bytes) -> bytes:
    """v codes as byte differences from the previous coordinate's (mod 256; lossless: a
    running sum gives them back)."""
    a = np.frombuffer(data, np.uint8)
    return np.diff(a, prepend=np.uint8(0)).astype(np.uint8).tobytes()


def entropy_bytes(x) -> float:
    """Order-0 empirical entropy of `x` in bytes (no table counted: a floor)."""
    c = np.unique(np.asarray(x), return_counts=True)[1]
    return float(-(c * np.log2(c / c.sum())).sum()) / 8


def conditional_entropy_bytes(x, ctx) -> float:
    """Sum over the values of `ctx` of `x`'s order-0 entropy where ctx has that value, in
    bytes (no tables counted: a floor, and on small entries an optimistic one)."""
    x, ctx = np.asarray(x), np.asarray(ctx)
    return sum(entropy_bytes(x[ctx == c]) for c in np.unique(ctx))


def lzma_bytes(data: bytes, lc=4) -> int:
    """A raw LZMA1 stream of `data` (the standard library's lzma, preset 9): its literal
    coder's context is the previous byte's top `lc` bits, so over interleaved (v, m) codes
    each m code is coded given its v code's top bits, adaptively (no table sent)."""
    import lzma
    flt = [{"id": lzma.FILTER_LZMA1, "preset": 9, "lc": lc, "lp": 0, "pb": 0}]
    packed = lzma.compress(data, format=lzma.FORMAT_RAW, filters=flt)
    assert lzma.decompress(packed, format=lzma.FORMAT_RAW, filters=flt) == data
    return len(packed)


def _mv_codes(n, dec):
    """(m, v) low-byte codes of an entry, uint8 [n] each, or None where a section is not n bytes."""
    m, v = (np.frombuffer(dec[k], np.uint8) for k in ("m_codes", "v_codes"))
    return (m, v) if m.size == n and v.size == n else None


def static_context_bytes(train, test, alpha=0.5) -> float:
    """Bytes of `test` under a static model of p(x | context) fitted on `train` (lists of
    (symbols, contexts)), add-alpha: what an arithmetic coder with a shipped table would
    store (tables not counted)."""
    xs, cs = (np.concatenate([t[i] for t in train]) for i in (0, 1))
    k = int(max(cs.max(), max(t[1].max() for t in test))) + 1
    counts = np.full((k, 256), alpha)
    np.add.at(counts, (cs, xs), 1)
    prob = counts / counts.sum(1, keepdims=True)
    return float(sum(-np.log2(prob[c, x]).sum() for x, c in test)) / 8


def _v_wide(n, dec):
    """(coordinates of the blocks whose v is wider than 8 bits, their whole v codes)."""
    from jaxguard.format.spec import BLOCK
    bv = np.frombuffer(dec["widths"], np.uint8) & 15
    rows = np.flatnonzero(bv > 8)
    coords = (rows[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)
    coords = coords[coords < n]
    low = np.frombuffer(dec["v_codes"], np.uint8)[coords].astype(np.int64)
    return coords, low | (np.frombuffer(dec["v_high"], np.uint8).astype(np.int64) << 8)


def _top_bits(n, dec):
    """(v_codes with each 10-bit block's codes as their top 8 bits, their low 2 bits packed
    4 a byte): the bytes that replace an entry's v_codes and v_high."""
    coords, whole = _v_wide(n, dec)
    if (whole >> 10).any():
        raise AssertionError("a v block wider than 10 bits")
    v = np.frombuffer(dec["v_codes"], np.uint8).copy()
    v[coords] = (whole >> 2).astype(np.uint8)
    return [v.tobytes(), np.packbits(np.unpackbits((whole & 3).astype(np.uint8)[:, None], axis=1)[:, 6:]).tobytes()]


def _by_width(dec):
    """An entry's v low bytes as two streams: of its 8-bit blocks, of its wider ones."""
    v = np.frombuffer(dec["v_codes"], np.uint8)
    if "v_high" not in dec:
        return [dec["v_codes"]]
    coords, _ = _v_wide(v.size, dec)
    wide = np.zeros(v.size, bool)
    wide[coords] = True
    return [v[~wide].tobytes(), v[wide].tobytes()]


def adaptive_bytes(x, ctx, alpha=0.5) -> float:
    """Bytes an adaptive arithmetic coder stores for `x` (uint8 symbols) in contexts `ctx`:
    the sequential Krichevsky-Trofimov estimate, counts starting at `alpha`, no table sent
    (within 2 bytes of a real coder's output)."""
    counts = np.zeros((int(ctx.max()) + 1 if ctx.size else 1, 256))
    seen = np.zeros(counts.shape[0])
    bits = 0.0
    for s, c in zip(x.tolist(), ctx.tolist()):
        bits -= np.log2((counts[c, s] + alpha) / (seen[c] + 256 * alpha))
        counts[c, s] += 1
        seen[c] += 1
    return bits / 8


def _adaptive_inputs(dec, key):
    """(symbols, contexts) of an entry's m (context: v's top 2 bits) or v low bytes
    (context: the previous coordinate's v, top 2 bits)."""
    m, v = (np.frombuffer(dec[k], np.uint8).astype(np.int64) for k in ("m_codes", "v_codes"))
    return (m, v >> 6) if key == "m_codes" else (v, np.concatenate([[0], v[:-1]]) >> 6)


def _prev_context(data: bytes):
    a = np.frombuffer(data, np.uint8).astype(np.int64)
    return a, np.concatenate([[0], a[:-1]]) >> 5        # the previous code's top 3 bits


def _dictionaries(train_ckpts, size=1024):
    """A zstd dictionary per stream kind (m_codes, v_codes, v_codes as deltas, params),
    trained on the entries of `train_ckpts`."""
    import zstandard as zs
    out = {}
    for key, fn in (("m_codes", None), ("v_codes", None), ("v_delta", v_delta), ("params", None)):
        src = "v_codes" if key == "v_delta" else key
        samples = [fn(d[src]) if fn else d[src] for c in train_ckpts for *_, d in c["entries"] if len(d[src]) >= 8]
        out[key] = zs.train_dictionary(size, samples * max(1, -(-64 // len(samples))), level=1)
    return out


def transforms(c, dicts, train_ckpts, foreign):
    """{transform: payload bytes} of checkpoint `c` (every section that a transform does not
    change stored as it is now); `dicts` trained on other seeds of its model, `foreign` on
    the other models."""
    ents = c["entries"]
    now = {k: sum(s.get(k, 0) for _, _, s, _ in ents) for k in STREAMS + ("escape_pairs",)}
    total = sum(now.values())

    def per_entry(key, fn=lambda b: stream_bytes(b), src=None):
        return sum(fn(d[src or key]) for *_, d in ents if (src or key) in d)

    def merged(key, fn=None, dictionary=None):
        return stream_bytes(b"".join(fn(d[key]) if fn else d[key] for *_, d in ents if key in d), 1, dictionary)

    def swap(**new):
        return total + sum(v - now[k] for k, v in new.items())

    out = {"as stored (log8-rel-zstd today)": total}
    out["zstd level 19, per entry"] = swap(**{k: per_entry(k, lambda b: stream_bytes(b, 19)) for k in
                                              ("m_codes", "v_codes", "params")})
    d_m, d_v = (per_entry(k, lambda b, k=k: stream_bytes(b, 1, dicts[k])) for k in ("m_codes", "v_codes"))
    d_p = per_entry("params", lambda b: stream_bytes(b, 1, dicts["params"]))
    out["shipped zstd dictionary (1 KiB each: m, v, params), per entry"] = swap(m_codes=d_m, v_codes=d_v, params=d_p)
    for label, ds in (("", dicts), (", trained on the other two models", foreign)):
        flagged = sum(stream_bytes(d["m_codes"], 1, ds["m_codes"]) + stream_bytes(d["params"], 1, ds["params"])
                      + min(stream_bytes(d["v_codes"], 1, ds["v_codes"]),
                            stream_bytes(v_delta(d["v_codes"]), 1, ds["v_delta"])) for *_, d in ents)
        out[f"dictionaries{label} + v deltas where smaller (a flag per entry)"] = swap(
            m_codes=flagged, v_codes=0, params=0)
    vd = per_entry("v_codes", lambda b: stream_bytes(v_delta(b)))
    out["v codes as deltas, per entry"] = swap(v_codes=vd)
    vdd = per_entry("v_codes", lambda b: stream_bytes(v_delta(b), 1, dicts["v_delta"]))
    out["v deltas + dictionaries, per entry"] = swap(m_codes=d_m, v_codes=vdd, params=d_p)
    merged_all = {k: merged(k) for k in STREAMS if now[k]}
    out["entries merged: one stream per section for the file"] = swap(**merged_all)
    best = dict(merged_all, m_codes=merged("m_codes", None, dicts["m_codes"]),
                v_codes=merged("v_codes", v_delta, dicts["v_delta"]), params=merged("params", None, dicts["params"]))
    out["entries merged + v deltas + dictionaries"] = swap(**best)
    top = sum(sum(stream_bytes(part) for part in _top_bits(n, d)) - stream_bytes(d["v_codes"])
              for _, n, _, d in ents if "v_high" in d)          # replaces the v_high streams
    out["10-bit v blocks: the code's top 8 bits in v_codes, its low 2 bits packed (4 a byte), per entry"] = \
        swap(v_high=top) if now["v_high"] else total
    split = sum(sum(stream_bytes(part) for part in _by_width(d)) for *_, d in ents)
    out["v low bytes split by block width (8-bit, 10-bit blocks), per entry"] = swap(v_codes=split)
    pick = dict(best, v_codes=min(best["v_codes"], merged("v_codes", None, dicts["v_codes"])))
    out["entries merged + dictionaries + v deltas where smaller (a flag per file)"] = swap(**pick)
    # floors: no table, no header
    joint = sum(entropy_bytes(_v_wide(n, d)[1]) - entropy_bytes(_v_wide(n, d)[1] & 255) for _, n, _, d in ents
                if "v_high" in d)
    out["floor: high bytes of 10-bit v at H(high given low byte) (the whole code's order-0 entropy less its low "
        "byte's)"] = swap(v_high=joint) if now["v_high"] else total
    codes_h0 = sum(entropy_bytes(np.frombuffer(d[k], np.uint8)) for *_, d in ents for k in ("m_codes", "v_codes"))
    out["floor: m, v low bytes at their per-entry order-0 entropy (no tables)"] = swap(m_codes=codes_h0, v_codes=0)
    out["floor: both floors above together"] = swap(m_codes=codes_h0, v_codes=0, v_high=joint) if now["v_high"] \
        else out["floor: m, v low bytes at their per-entry order-0 entropy (no tables)"]
    adaptive = sum(adaptive_bytes(*_adaptive_inputs(d, k)) for *_, d in ents for k in ("m_codes", "v_codes"))
    out["adaptive arithmetic coding, no table: m given v's top 2 bits, v given the previous v's, per entry"] = swap(
        m_codes=adaptive, v_codes=0)
    train = {k: [_prev_context(d[k]) for t in train_ckpts for *_, d in t["entries"]] for k in ("m_codes", "v_codes")}
    ctx = sum(static_context_bytes(train[k], [_prev_context(d[k]) for *_, d in ents]) for k in ("m_codes", "v_codes"))
    mv = [(_mv_codes(n, d), s_) for _, n, s_, d in ents]
    stored_mv = [s_["m_codes"] + s_["v_codes"] for _, s_ in mv]
    xz = sum(st if x is None else min(st, lzma_bytes(np.stack([x[1], x[0]], 1).tobytes()))
             for (x, _), st in zip(mv, stored_mv))
    out["LZMA (standard library, literal context: the previous byte's top 4 bits) over each entry's v, m codes "
        "interleaved, where smaller than zstd"] = swap(m_codes=xz, v_codes=0)
    cond = sum(st if x is None else conditional_entropy_bytes(x[0], x[1] >> 4) + entropy_bytes(x[1])
               for (x, _), st in zip(mv, stored_mv))
    out["floor: m given its v code's top 4 bits, v at order 0, per entry (no tables)"] = swap(m_codes=cond, v_codes=0)
    return out


def breakdown(c):
    """{part: bytes} of checkpoint `c` as stored now."""
    rows = {}
    small = 0
    for _, n, sizes, dec in c["entries"]:
        for key, stored in sizes.items():
            hdr = 0 if key == "escape_pairs" else header_bytes(dec[key], stored)
            part = {"escape_index": "escapes (index + pairs)", "escape_pairs": "escapes (index + pairs)",
                    "m_high": "10-bit blocks (widths, high bytes)", "v_high": "10-bit blocks (widths, high bytes)",
                    "widths": "10-bit blocks (widths, high bytes)"}.get(key, key)
            rows[part] = rows.get(part, 0) + stored - hdr
            rows["stream headers (varints)"] = rows.get("stream headers (varints)", 0) + hdr
        if n < 256:
            small += len(dec["params"])
    rows["of params: blocks of entries under 256 coordinates"] = small
    return rows


def analyse(cache: Path, out: Path):
    import zstandard
    with open(cache / PICKLE, "rb") as fh:
        ckpts = pickle.load(fh)
    table, parts, meta = {}, {}, {}
    foreign = {m: _dictionaries([c for c in ckpts if c["model"] != m]) for m in MODELS}
    for model in MODELS:
        cs = [c for c in ckpts if c["model"] == model]
        seeds = sorted({c["seed"] for c in cs})
        halves = (set(seeds[:len(seeds) // 2]), set(seeds[len(seeds) // 2:]))
        for held_in in halves:
            train = [c for c in cs if c["seed"] not in held_in]
            dicts = _dictionaries(train)
            for c in (c for c in cs if c["seed"] in held_in):
                fp32 = sum(8 * n for _, n, _, _ in c["entries"])
                for t, b in transforms(c, dicts, train, foreign[model]).items():
                    table.setdefault(t, {}).setdefault(model, []).append(100 * b / fp32)
                for p, b in breakdown(c).items():
                    parts.setdefault(p, {}).setdefault(model, []).append((b, 100 * b / fp32))
        meta[model] = (len(cs), sum(n for _, n, _, _ in cs[0]["entries"]), len(cs[0]["entries"]))

    def cell(vals):
        return f"{np.mean(vals):.2f} ({min(vals):.2f}-{max(vals):.2f}) {sum(v <= TARGET for v in vals)}/{len(vals)}"

    lines = ["# log8-rel-zstd on the small reproduction checkpoints: where the bytes go, what lossless transforms gain",
             "", "Commands: `python bench/experiments/zstd_small_payload.py collect` then `python "
             "bench/experiments/zstd_small_payload.py analyse`. Checkpoints: bench/reproduce.py's (tau 0.01, C 0.2, "
             "log8-rel-zstd as `torch_compat.compress_checkpoint` and `jaxguard.save` write it): "
             + "; ".join(f"{m} {k} checkpoints, {n:,} coordinates in {e} entries" for m, (k, n, e) in meta.items())
             + f". zstandard {zstandard.__version__}, zstd level 1 unless said. Payload = the entries' sections, "
             "as bench/reproduce.py counts it; % of FP32 = of 8 bytes a coordinate.", "",
             "## Where the bytes go (as stored today)", "",
             "Mean over the checkpoints of each model: bytes, and % of FP32 (min-max).", "",
             "| part | " + " | ".join(MODELS) + " |", "|---|" + "---:|" * len(MODELS)]
    def part_cell(vals):
        b, r = (np.array([x[i] for x in vals or [(0, 0)]]) for i in (0, 1))
        return f"{b.mean():,.0f} B, {r.mean():.2f}% ({r.min():.2f}-{r.max():.2f})"

    for p, per in parts.items():
        lines.append(f"| {p} | " + " | ".join(part_cell(per.get(m)) for m in MODELS) + " |")
    lines += ["", "## Transforms (lossless; the codes, parameters and escapes unchanged)", "",
              f"Payload % of FP32: mean (min-max) and checkpoints at or under {TARGET}%. Shipped dictionaries and "
              "static models are trained on half of the seeds of a model and measured on the other half (and with the "
              "halves swapped): the figures are held out. Every zstd figure is a real frame decoded back; the "
              "floors are entropies, not stored sizes.", "",
              "| transform | " + " | ".join(MODELS) + " |", "|---|" + "---:|" * len(MODELS)]
    for t, per in table.items():
        lines.append(f"| {t} | " + " | ".join(cell(per[m]) for m in MODELS) + " |")
    def met(t, m):
        return f"{sum(v <= TARGET for v in table[t][m])}/{len(table[t][m])}"

    kernel_bits = [8 * entropy_bytes(np.frombuffer(d[k], np.uint8)) / n for c in ckpts if c["model"] == "cnn"
                   for _, n, _, d in c["entries"] if n == max(e[1] for e in c["entries"])
                   for k in ("m_codes", "v_codes")]
    best, floor = "entries merged + dictionaries + v deltas where smaller (a flag per file)", \
        "floor: both floors above together"
    cond = "floor: m given its v code's top 4 bits, v at order 0, per entry (no tables)"
    xz = next(t for t in table if t.startswith("LZMA"))
    worst = {m: max(table[floor][m]) for m in MODELS}
    lines += ["", "## Reading", "",
              f"* The best measured storage (entries merged into one stream per section for the file, shipped "
              f"dictionaries, v as deltas where smaller) meets {TARGET}% on {met(best, 'cnn')} CNN and "
              f"{met(best, 'mlp-optax')} MLP checkpoints (today 0/12 and 3/12). The merge needs a file-level section "
              "(the container stores sections per entry), the dictionaries a fixed blob shipped with the format.",
              f"* Floors: with every entry's m and v low bytes at their own order-0 entropy, with no table and no "
              f"header, and the 10-bit blocks' high bytes at H(high given low byte), the payload is still above "
              f"{TARGET}% on {len(table[floor]['cnn']) - sum(v <= TARGET for v in table[floor]['cnn'])} CNN "
              f"(worst {worst['cnn']:.2f}%) and "
              f"{len(table[floor]['mlp-optax']) - sum(v <= TARGET for v in table[floor]['mlp-optax'])} MLP "
              f"checkpoints (worst {worst['mlp-optax']:.2f}%). A held-out static context model (previous code) "
              "stores more than the per-entry order-0 floor on the CNN and the MLP, and an adaptive "
              "arithmetic coder with contexts (no table to send) stores more than zstd's best above. So the "
              "target is not reachable on every small checkpoint by storing the same codes losslessly with "
              "byte-wise entropy coding: what is left is in the codes themselves "
              f"({min(kernel_bits):.2f}-{max(kernel_bits):.2f} bits a code, order-0, for m and v on the CNN's "
              "largest kernels), the "
              "MLP's 10-bit v blocks and escapes (what the writer chose to certify), and the block parameters of "
              "tensors under 256 coordinates (12 bytes a block).",
              f"* Coding m given its own v code does reach below the target as a floor: m at its per-entry "
              f"entropy given v's top 4 bits meets {TARGET}% on {met(cond, 'cnn')} CNN and {met(cond, 'mlp-optax')} "
              f"MLP checkpoints (worst {max(table[cond]['cnn']):.2f}% and {max(table[cond]['mlp-optax']):.2f}%; no "
              "table counted, so optimistic on entries of a few hundred codes). A kept library's adaptive coder with "
              f"that context does not get there: LZMA over interleaved (v, m) codes meets it on {met(xz, 'cnn')} CNN "
              f"and {met(xz, 'mlp-optax')} MLP checkpoints (worst {max(table[xz]['cnn']):.2f}%, "
              f"{max(table[xz]['mlp-optax']):.2f}%): its learning cost over 256 symbols and 16 contexts is paid on "
              "every small entry. What could is a static model of p(m | v's top bits) shipped with the format "
              "under a range coder (the format's own rANS, not a kept library)."]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    print(text)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("collect", "analyse"))
    ap.add_argument("--cache", default=str(ROOT / "bench" / ".cache"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "experiments" / "results" / "zstd_small_payload.md"))
    a = ap.parse_args(argv)
    if a.what == "collect":
        collect(Path(a.cache))
    else:
        analyse(Path(a.cache), Path(a.out))


if __name__ == "__main__":
    main()
