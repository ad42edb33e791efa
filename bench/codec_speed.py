"""What the certificate costs next to the save it replaces: whole processes, peak memory,
and certification throughput from 1M to 100M coordinates.

    python bench/codec_speed.py [--replicas 19] [--repeats 3] [--sweep 1,4,16,64,100] [--codec log8-rel]
                                [--out bench/results/codec_speed_16m] [--work DIR] [--one-core]
    python bench/codec_speed.py --gpt2 [--steps 3] --sweep ""      # bench/results/codec_speed_gpt2.*
    python bench/codec_speed.py --gpt2-large --sweep "" --repeats 2   # bench/results/codec_speed_gpt2_large.*
    python bench/codec_speed.py --src CKPT --codec log8-rel-zstd --also-codec log8-rel --restore-only --no-cold \
        --sweep "" [--before DIR] --out bench/results/codec_speed_zstd        # the default's restore beside log8-rel's

With ``--gpt2`` the checkpoint is GPT-2 small instead (transformers' ``GPT2LMHeadModel(GPT2Config())``,
built here, no download: 124,439,808 parameters, the real ``torch.optim.AdamW`` over
``model.named_parameters()`` for --steps steps on the standard library's source bytes as tokens),
saved as ``{"model": sd, "optimizer": osd}`` (~1.5 GB); ``--src FILE`` reuses a checkpoint built
before; ``--sweep ""`` skips the in-process sweep; ``--one-core`` adds the compress held to
one CPU (``taskset``), interleaved with the others.

1. A ByteTransformer (d=128, 4 layers, 867,328 Adam coordinates) is trained for --steps
   Adam steps on the standard library's source; its checkpoint is replicated --replicas
   times (parameters renamed r{i}.*, one param group) into one torch checkpoint
   (19 -> 16,479,232 coordinates, 199 MB).
2. Whole processes, as a user runs them, measured side by side and interleaved (plain,
   compress, restore; plain, compress, restore; ...) so that load from other jobs hits
   all three alike: ``python -c "torch.save(torch.load(src), dst)"``, ``jaxguard compress
   src -o out``, ``jaxguard restore out -o back.pt``. Wall time and the child's own peak
   RSS (GNU ``/usr/bin/time -f %M``). One cold compress first with an empty cache directory
   (``XDG_CACHE_HOME``): it pays the variant detection and the XLA compilations and fills
   the caches; then one compress with ``jax_log_compiles`` counts the programs compiled
   vs read from the persistent cache, and whether the variant came from its cache.
3. In-process encode throughput (`jaxguard.writer.container_entries` of `torch_compat.state.state_records`, slabs as in
   the CLI) on the trained state tiled to each --sweep size (millions of coordinates),
   each size encoded twice and the second pass timed (`sweep`), with and without building
   the records; the least-squares slopes seconds/coordinate are reported.

Writes JSON, Markdown and a PNG next to --out (default: bench/results/codec_speed_16m, or
codec_speed_gpt2 with --gpt2, codec_speed_gpt2_large with --gpt2-large, each followed by _CODEC when
--codec is not log8-rel).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_checkpoint(steps):
    from torch_compat import models
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny model on shared cores (see torch_compat/models.py)
    model = models.ByteTransformer(d=128, layers=4, heads=4, ctx=64)
    sample = models.text_batches(0)
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3, foreach=False)
    for _ in range(steps):
        opt.zero_grad()
        models.loss_fn(model, sample(True)).backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


GPT2_LARGE = dict(n_embd=1280, n_layer=36, n_head=20)   # 774M parameters (~9.3 GB with its AdamW state)


def train_gpt2(steps, batch=2, ctx=128, large=False):
    """GPT-2 small (124M parameters; `large`: GPT-2 large, 774M) trained `steps` AdamW steps
    on standard-library bytes."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from torch_compat import models
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**(GPT2_LARGE if large else {})))
    sample = models.text_batches(0, batch=batch, ctx=ctx)
    opt = torch.optim.AdamW(model.named_parameters(), lr=3e-4, weight_decay=0.01)
    for _ in range(steps):
        opt.zero_grad()
        x, y = sample(True)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def replicate(ckpt, r):
    """One param group, every parameter and its Adam state repeated r times (renamed)."""
    model, opt = ckpt["model"], ckpt["optimizer"]
    (g0,) = opt["param_groups"]
    new_model, new_state, names, idxs = {}, {}, [], []
    for i in range(r):
        for name, idx in zip(g0["param_names"], g0["params"]):
            nm = f"r{i}.{name}"
            new_model[nm] = model[name].clone()
            st = opt["state"][idx]
            new_state[len(idxs)] = {k: v.clone() for k, v in st.items()}
            names.append(nm)
            idxs.append(len(idxs))
    return {"model": new_model, "optimizer": {"state": new_state,
                                              "param_groups": [{**g0, "params": idxs, "param_names": names}]}}


def run_child(argv, env, cwd=None):
    """(wall seconds, peak RSS bytes of that child alone, stdout, stderr) of one process.

    The peak RSS comes from GNU time (``/usr/bin/time -f %M``): ``wait4`` on a child
    forked from this (large) process would count the parent's pages it shared before
    exec."""
    if not os.path.exists("/usr/bin/time"):
        return _run_child_wait4(argv, env, cwd)
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        cmd = ["/usr/bin/time", "-f", "%M", "-o", rss.name, *argv]
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        peak_kib = int(rss.read().strip().splitlines()[-1])
    return wall, peak_kib * 1024, proc.stdout, proc.stderr


def _run_child_wait4(argv, env, cwd=None):
    """`run_child` without GNU time: the child's own ``ru_maxrss`` (KiB on Linux) from
    ``wait4`` (its high-water mark also counts the pages of this process it touched before
    exec, so it can read high)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text, etext = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {etext[-2000:]}")
    return wall, usage.ru_maxrss * 1024, text, etext


def same_tree(x, y) -> bool:
    """The same object: types, keys in order, tensors' dtype/shape/stride and bytes."""
    if type(x) is not type(y):
        return False
    if isinstance(x, dict):
        return list(x) == list(y) and all(same_tree(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(same_tree(a, b) for a, b in zip(x, y))
    if isinstance(x, torch.Tensor):
        if (x.dtype, x.shape, x.stride()) != (y.dtype, y.shape, y.stride()):
            return False
        a, b = x.contiguous().reshape(-1), y.contiguous().reshape(-1)
        return a.numel() == 0 or bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    return x == y or (x != x and y != y)


def whole_process(src, work, repeats, env, codec="log8-rel", cold=True, before=None, one_core=False, also=None,
                  durable=False, sync_between=False, restore_only=False):
    py = sys.executable
    plain = [py, "-c", "import sys, torch; torch.save(torch.load(sys.argv[1], weights_only=True), sys.argv[2])",
             src, os.path.join(work, "plain.pt")]
    # the same save made durable as jaxguard's writes are (fsync before returning): the plain
    # save leaves its 1.5 GB in the page cache, and its time follows the machine's dirty memory
    plain_fsync = [py, "-c", "import os, sys, torch\nwith open(sys.argv[2], 'wb') as f:\n"
                   "    torch.save(torch.load(sys.argv[1], weights_only=True), f); f.flush(); os.fsync(f.fileno())",
                   src, os.path.join(work, "plain_fsync.pt")]
    out = os.path.join(work, "c.jg")
    compress = [py, "-m", "jaxguard", "compress", src, "-o", out, "--json", "--codec", codec]
    restore = [py, "-m", "jaxguard", "restore", out, "-o", os.path.join(work, "back.pt")]
    res = {"cold_compress": None, "second_run": None, "plain": [], "compress": [], "restore": []}
    summary = None
    if cold:
        w, r, text, _ = run_child(compress, env)
        res["cold_compress"] = {"seconds": w, "peak_rss": r}
        summary = _json_summary(text)
        # a second fresh process: what does it compile, and does it detect the variant again?
        probe = [py, "-c", "import sys, jax; jax.config.update('jax_log_compiles', True); "
                 "from jaxguard import cli; rc = cli.main(sys.argv[1:]); "
                 "print('torch imported:', 'torch' in sys.modules, file=sys.stderr); sys.exit(rc)",
                 "compress", src, "-o", out, "--json",
                 "--codec", codec]
        w, r, out_, err_ = run_child(probe, env)
        text = out_ + err_
        compiled = text.count("Compiling ")
        hits = text.count("Persistent compilation cache hit")
        res["second_run"] = {"programs": compiled, "persistent_cache_hits": hits, "compiled_anew": compiled - hits,
                             "variant_detection_warning": "ReplayVariantWarning" in text, "seconds": w,
                             "torch_imported": "torch imported: True" in text}
    runs = [("plain", plain, env, ROOT), ("compress", compress, env, ROOT), ("restore", restore, env, ROOT)]
    if restore_only:   # each codec compressed once, untimed: the restores are what is timed
        summary = _json_summary(run_child(compress, env)[2])
        runs = [r for r in runs if r[0] != "compress"]
    if before:   # the compress and restore of another checkout (e.g. `git archive` of the commit before)
        res["compress_before"], res["restore_before"] = [], []   # run from that directory: `python -m` puts the cwd first
        env0 = {**env, "PYTHONPATH": before + os.pathsep + os.environ.get("PYTHONPATH", "")}
        out0 = os.path.join(work, "c0.jg")
        compress0 = [py, "-m", "jaxguard", "compress", src, "-o", out0, "--json", "--codec", codec]
        if restore_only:
            run_child(compress0, env0, before)
        else:
            runs.append(("compress_before", compress0, env0, before))
        # the before's own file: a reader older than the file's integrity hash refuses it
        runs.append(("restore_before", [py, "-m", "jaxguard", "restore", out0, "-o", os.path.join(work, "back0.pt")],
                     env0, before))
    if also:   # another codec's compress and restore of the same checkpoint, interleaved (e.g. log8-rel)
        out_a = os.path.join(work, "c_also.jg")
        compress_also = [py, "-m", "jaxguard", "compress", src, "-o", out_a, "--json", "--codec", also]
        if restore_only:
            res["also_summary"] = _json_summary(run_child(compress_also, env)[2])
        else:
            runs.append(("compress_also", compress_also, env, ROOT))
        runs.append(("restore_also", [py, "-m", "jaxguard", "restore", out_a, "-o", os.path.join(work, "back_a.pt")],
                     env, ROOT))
    if durable:
        runs.insert(1, ("plain_fsync", plain_fsync, env, ROOT))
    if one_core:   # the same compress held to one CPU: what the second core buys
        runs.append(("compress_1core", ["taskset", "-c", str(min(os.sched_getaffinity(0))), *compress], env, ROOT))
    keys = [k for k, _, _, _ in runs]
    for _ in range(repeats):        # interleaved: the same load for all of them
        for key, argv, env_k, cwd in runs:
            if sync_between:   # start every run with no dirty page cache left by the one before (not timed)
                os.sync()
            w, r, text, _ = run_child(argv, env_k, cwd)
            res.setdefault(key, []).append({"seconds": w, "peak_rss": r})
            if key == "compress" and summary is None:
                summary = _json_summary(text)
            if key == "compress_also" and "also_summary" not in res:
                res["also_summary"] = _json_summary(text)
            print(f"  {key:>14}: {w:7.2f} s  {r / 2**20:7.1f} MiB", flush=True)
    if before and not restore_only:
        res["container_hashes_identical_to_before"] = _hashes(out) == _hashes(out0)
    if before:
        res["restored_identical_to_before"] = same_tree(torch.load(os.path.join(work, "back0.pt"), weights_only=True),
                                                        torch.load(os.path.join(work, "back.pt"), weights_only=True))
    med = {k: {"seconds": statistics.median(x["seconds"] for x in res[k]),
               "peak_rss": statistics.median(x["peak_rss"] for x in res[k])} for k in keys}
    ratios = {f"{k}_{q}": med[k][f] / med["plain"][f] for k in ("compress", "restore") if k in med
              for q, f in (("time", "seconds"), ("rss", "peak_rss"))}
    if durable:
        ratios.update(plain_fsync_time=med["plain_fsync"]["seconds"] / med["plain"]["seconds"],
                      compress_vs_durable_plain=med["compress"]["seconds"] / med["plain_fsync"]["seconds"],
                      restore_vs_durable_plain=med["restore"]["seconds"] / med["plain_fsync"]["seconds"])
    if one_core:
        ratios.update(compress_1core_time=med["compress_1core"]["seconds"] / med["plain"]["seconds"],
                      compress_1core_rss=med["compress_1core"]["peak_rss"] / med["plain"]["peak_rss"],
                      cores_speedup=med["compress_1core"]["seconds"] / med["compress"]["seconds"])
    if before:
        ratios.update({f"{k}_before_{q}": med[f"{k}_before"][f] / med["plain"][f] for k in ("compress", "restore")
                       if f"{k}_before" in med for q, f in (("time", "seconds"), ("rss", "peak_rss"))})
        if also:
            ratios["restore_before_vs_also"] = med["restore_before"]["seconds"] / med["restore_also"]["seconds"]
            ratios["restore_before_vs_also_pairwise"] = statistics.median(
                a["seconds"] / b["seconds"] for a, b in zip(res["restore_before"], res["restore_also"]))
    if also:
        ratios.update({f"{k}_also_{q}": med[f"{k}_also"][f] / med["plain"][f] for k in ("compress", "restore")
                       if f"{k}_also" in med for q, f in (("time", "seconds"), ("rss", "peak_rss"))})
        ratios["restore_vs_also"] = med["restore"]["seconds"] / med["restore_also"]["seconds"]
        # the ratio of medians, and the median of the pairwise ratios (each repeat's two restores ran back to back)
        ratios["restore_vs_also_pairwise"] = statistics.median(
            a["seconds"] / b["seconds"] for a, b in zip(res["restore"], res["restore_also"]))
        if "compress_also" in med:
            ratios["compress_vs_also"] = med["compress"]["seconds"] / med["compress_also"]["seconds"]
    per_run = [{k: res[k][i]["seconds"] / res["plain"][i]["seconds"] for k in keys if k != "plain"}
               for i in range(repeats)]
    extra = {"also_codec": also, "also_container_bytes": os.path.getsize(out_a)} if also else {}
    return {**res, "median": med, "ratios": ratios, "per_repeat_time_ratios": per_run, "summary": summary,
            "container_bytes": os.path.getsize(out), "source_bytes": os.path.getsize(src), **extra}


def _json_summary(text):
    """The summary `jaxguard compress --json` printed (its last line that is a JSON object)."""
    return json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])


def _hashes(container):
    """(payload SHA-256, decoded-moments SHA-256) of a container, computed here whatever
    integrity hash the file carries (a file sealed with BLAKE3 and one sealed with SHA-256
    of the same entries give the same pair)."""
    import hashlib
    from jaxguard.format import reader
    with open(container, "rb") as fh:
        header, payload = reader.parse(fh.read())
    return hashlib.sha256(payload).hexdigest(), reader.decoded_digest(header, payload, "sha256")


def tiled(base, r):
    """`base` (a one-group torch checkpoint) r times over: the same tensors referenced again
    under new names, no copies, so memory does not grow with r."""
    ck = {"model": {}, "optimizer": {"state": {}, "param_groups": []}}
    (g0,) = base["optimizer"]["param_groups"]
    names, idxs = [], []
    for i in range(r):
        for name, idx in zip(g0["param_names"], g0["params"]):
            ck["model"][f"r{i}.{name}"] = base["model"][name]
            ck["optimizer"]["state"][len(idxs)] = base["optimizer"]["state"][idx]
            names.append(f"r{i}.{name}")
            idxs.append(len(idxs))
    ck["optimizer"]["param_groups"] = [{**g0, "params": idxs, "param_names": names}]
    return ck


def sweep(base, sizes_m, codec="log8-rel"):
    """Each size encoded twice in this process; the second is timed.  The first meets slab
    shapes (the last slab's bucket) that no earlier size had, and compiles them (1.1-1.3 s
    at 15.6M coordinates after a 1.7M warm-up, seen with ``jax_log_compiles``); a fresh
    `jaxguard compress` reads them from its on-disk cache instead.  ``seconds`` covers
    `torch_compat.state.state_records` and `writer.container_entries`; ``encode_seconds`` the encode
    alone (the tiled state has 54 tensors a tile, and building a record costs about 0.2 ms
    a tensor, mostly jax's DLPack import of the three views)."""
    import torch_compat.state as S
    from jaxguard.audit import new_totals
    from jaxguard.core.config import GuardSpec
    rows = []
    per = sum(st["exp_avg"].numel() for st in base["optimizer"]["state"].values())

    def run(r):
        ck = tiled(base, r)
        totals = new_totals()
        t = time.perf_counter()
        from jaxguard import writer
        _, records = S.state_records(ck["optimizer"], ck["model"], spec=GuardSpec(codec=codec))
        t_enc = time.perf_counter()
        fast = 0
        for e in writer.container_entries(records, totals):
            if isinstance(e, writer.Moments):
                fast += e.encoded.stats["certified_fast"]
        end = time.perf_counter()
        return end - t, end - t_enc, totals, fast

    run(2)   # warm-up: compiles every slab shape once
    for m in sizes_m:
        r = max(1, round(m * 1e6 / per))
        first = run(r)[0]
        sec, enc, totals, fast = run(r)
        n = totals["coordinates"]
        rows.append({"coordinates": n, "seconds": sec, "coords_per_s": n / sec, "encode_seconds": enc,
                     "encode_coords_per_s": n / enc, "first_seconds": first, "escapes": totals["escapes"],
                     "exact": totals["exact"], "certified_fast": fast,
                     "payload_ratio": totals["payload_bytes"] / totals["raw_fp32_bytes"]})
        print(f"  sweep {n:>12,}: {sec:7.2f} s  {n / sec / 1e6:6.2f} M coords/s (encode alone {n / enc / 1e6:6.2f}; "
              f"first pass {first:.2f} s)  fast {fast:,}", flush=True)
    x = np.array([r["coordinates"] for r in rows], float)
    y = np.array([r["seconds"] for r in rows], float)
    slope, icpt = np.polyfit(x, y, 1) if len(rows) > 1 else (y[0] / x[0], 0.0)
    resid = y - (slope * x + icpt)
    ye = np.array([r["encode_seconds"] for r in rows], float)
    slope_e = np.polyfit(x, ye, 1)[0] if len(rows) > 1 else ye[0] / x[0]
    return {"rows": rows, "slope_s_per_coord": float(slope), "intercept_s": float(icpt),
            "max_rel_residual": float(np.max(np.abs(resid) / y)), "encode_slope_s_per_coord": float(slope_e)}


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = result["sweep"]
    fig, ax = plt.subplots(1, 2 if s else 1, figsize=(11 if s else 6, 4), squeeze=False)
    ax = ax[0]
    w = result["whole_process"]
    names = {"plain": "torch load+save", "compress": "jaxguard compress", "restore": f"restore {result['codec']}",
             "restore_also": f"restore {w.get('also_codec')}", "restore_before": "restore, --before"}
    keys = [k for k in names if k in w["median"] and (k in ("plain", "compress") or "compress" not in w["median"]
                                                      or k == "restore")]
    t = [w["median"][k]["seconds"] for k in keys]
    r = [w["median"][k]["peak_rss"] / 2**20 for k in keys]
    xs = np.arange(len(keys))
    ax[0].bar(xs - 0.2, t, 0.4, label="wall s")
    ax0b = ax[0].twinx()
    ax0b.bar(xs + 0.2, r, 0.4, color="tab:orange", label="peak RSS MiB")
    ax[0].set_xticks(xs, [names[k] for k in keys], fontsize=8)
    ax[0].set_ylabel("wall seconds (blue)")
    ax0b.set_ylabel("peak RSS MiB (orange)")
    ax[0].set_title(f"{w['summary']['coordinates']:,} coordinates, whole processes (medians)")
    if not s:
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return
    x = np.array([q["coordinates"] for q in s["rows"]])
    y = np.array([q["seconds"] for q in s["rows"]])
    ax[1].plot(x / 1e6, y, "o-", label="records + encode (in process)")
    ax[1].plot(x / 1e6, s["slope_s_per_coord"] * x + s["intercept_s"], "--",
               label=f"fit: {1 / s['slope_s_per_coord'] / 1e6:.2f} M coords/s")
    if "encode_seconds" in s["rows"][0]:
        ax[1].plot(x / 1e6, [q["encode_seconds"] for q in s["rows"]], "s-",
                   label=f"encode alone ({1 / s['encode_slope_s_per_coord'] / 1e6:.2f} M coords/s)")
    ax[1].set_xlabel("coordinates (millions)")
    ax[1].set_ylabel("seconds")
    ax[1].legend()
    ax[1].set_title("certification time vs size")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--replicas", type=int, default=19)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sweep", default="1,4,16,64,100")
    ap.add_argument("--out", default=None, help="path prefix of the results (default: bench/results/codec_speed_16m "
                                                "or _gpt2, then _CODEC for a codec other than log8-rel)")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--codec", default="log8-rel", help="the codec compressed with")
    ap.add_argument("--note", default="", help="what else ran on the machine (written into the results)")
    ap.add_argument("--gpt2", action="store_true", help="GPT-2 small (124M) trained --steps AdamW steps, not the "
                                                        "replicated ByteTransformer")
    ap.add_argument("--gpt2-large", action="store_true", help="GPT-2 large (774M, ~9.3 GB with its AdamW state; run "
                                                               "it alone on the machine) instead of GPT-2 small")
    ap.add_argument("--src", default=None, help="a checkpoint built before by this bench (skips training)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold compress and the compile probe (keeps the "
                                                           "caller's XDG cache: the caches are warm)")
    ap.add_argument("--before", default=None, help="a checkout of the code before (e.g. `git archive` of a commit): "
                                                   "its restore runs interleaved as one more process")
    ap.add_argument("--also-codec", default=None, help="another codec (e.g. log8-rel) whose compress and restore run "
                                                       "interleaved, for ratios between the two codecs")
    ap.add_argument("--one-core", action="store_true", help="also run the compress under `taskset -c` one CPU "
                                                            "(interleaved): the speedup of all cores over one")
    ap.add_argument("--sync-between", action="store_true", help="os.sync() before every timed process (untimed): the "
                    "plain save leaves its output dirty in the page cache, and its writeback otherwise lands on "
                    "whichever process runs next")
    ap.add_argument("--restore-only", action="store_true", help="compress each codec once, untimed, and time only the "
                                                                "restores (and the plain save) interleaved")
    ap.add_argument("--durable-plain", action="store_true", help="also run the plain save with an fsync before it "
                                                                 "returns (interleaved), as jaxguard's writes are")
    a = ap.parse_args(argv)
    a.gpt2 = a.gpt2 or a.gpt2_large
    if a.out is None:
        model = "gpt2_large" if a.gpt2_large else "gpt2" if a.gpt2 else "16m"
        a.out = os.path.join(ROOT, "bench", "results", "codec_speed_" + model
                             + ("" if a.codec == "log8-rel" else "_" + a.codec))

    import jax
    try:
        load0 = os.getloadavg()
    except OSError:
        load0 = None
    work = os.path.abspath(a.work or tempfile.mkdtemp(prefix="jaxguard-speed-"))
    os.makedirs(work, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if not a.no_cold:
        cache = os.path.join(work, "xdg-cache")
        shutil.rmtree(cache, ignore_errors=True)          # the first compress starts cold
        env["XDG_CACHE_HOME"] = cache
    if a.src:
        src, base = os.path.abspath(a.src), None
    else:
        base = train_gpt2(a.steps, large=a.gpt2_large) if a.gpt2 else train_checkpoint(a.steps)
        src = os.path.join(work, "src.pt")
        torch.save(base if a.gpt2 else replicate(base, a.replicas), src)
        if a.gpt2:
            base = None
    print(f"checkpoint: {os.path.getsize(src):,} bytes", flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    whole = whole_process(src, work, a.repeats, env, a.codec, cold=not a.no_cold,
                          before=os.path.abspath(a.before) if a.before else None, one_core=a.one_core,
                          also=a.also_codec, durable=a.durable_plain, sync_between=a.sync_between,
                          restore_only=a.restore_only)
    whole["sync_between"] = a.sync_between
    with open(a.out + ".partial.json", "w") as fh:   # in case the sweep is cut short
        json.dump(whole, fh, indent=1)
    sizes = [float(x) for x in a.sweep.split(",") if x]
    if sizes and base is None:
        base = train_checkpoint(a.steps)
    sw = sweep(base, sizes, a.codec) if sizes else None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        commit = None
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    result = {"machine": {"platform": platform.platform(), "processor": cpu, "cpus": os.cpu_count(),
                          "loadavg_at_end": load,
                          "note": a.note + ("; " if a.note else "") + "the ratios were measured side by side, "
                                  "interleaved"},
              "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "jax": jax.__version__},
              "commit": commit, "codec": a.codec, "steps": a.steps, "replicas": a.replicas, "repeats": a.repeats,
              "model": "gpt2-large" if a.gpt2_large else "gpt2" if a.gpt2 else "byte-transformer",
              "src": os.path.basename(a.src) if a.src else None,
              "load_at_start": load0,
              "whole_process": whole, "sweep": sw}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as fh:
        json.dump(result, fh, indent=1)
    plot(result, a.out + ".png")
    write_md(result, a.out + ".md")
    os.unlink(a.out + ".partial.json")
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)


def write_md(res, path):
    w, s = res["whole_process"], res["sweep"]
    med, rat = w["median"], w["ratios"]
    mib = lambda b: b / 2**20  # noqa: E731
    sm = w["summary"]
    lines = [
        f"# Codec speed: {sm['coordinates']:,} Adam coordinates ("
        + (f"the checkpoint `{res['src']}` given with --src" if res.get("src")
           else "GPT-2 small, transformers' GPT2Config(), AdamW" if res.get("model") == "gpt2"
           else f"ByteTransformer x{res['replicas']}") + f", {res.get('codec', 'log8-rel')})",
        "",
        f"Machine: {res['machine']['processor'] or platform.machine()}, {res['machine']['cpus']} cores, "
        f"{res['machine']['note']}; load average at the start {res.get('load_at_start')}, at the end "
        f"{res['machine']['loadavg_at_end']}. "
        f"Commit {res['commit']}, torch {res['versions']['torch']}, jax {res['versions']['jax']}.",
        "",
        f"## Whole processes (medians of {res['repeats']}, interleaved)",
        "",
        "| | wall s | x plain | peak RSS MiB | x plain |",
        "|---|---:|---:|---:|---:|",
        f"| `torch.save(torch.load(src))` | {med['plain']['seconds']:.2f} | 1 | {mib(med['plain']['peak_rss']):.0f} | 1 |",
        *([f"| the same, durable (`torch.save` to a file, then fsync) | {med['plain_fsync']['seconds']:.2f} | "
           f"{rat['plain_fsync_time']:.2f} | {mib(med['plain_fsync']['peak_rss']):.0f} | "
           f"{med['plain_fsync']['peak_rss'] / med['plain']['peak_rss']:.2f} |"] if "plain_fsync" in med else []),
        *([f"| `jaxguard compress src -o out` | {med['compress']['seconds']:.2f} | {rat['compress_time']:.2f} | "
           f"{mib(med['compress']['peak_rss']):.0f} | {rat['compress_rss']:.2f} |"] if "compress" in med else []),
        f"| `jaxguard restore out -o back.pt` | {med['restore']['seconds']:.2f} | {rat['restore_time']:.2f} | "
        f"{mib(med['restore']['peak_rss']):.0f} | {rat['restore_rss']:.2f} |",
        *([f"| `jaxguard compress` before (`--before` checkout) | {med['compress_before']['seconds']:.2f} | "
           f"{rat['compress_before_time']:.2f} | {mib(med['compress_before']['peak_rss']):.0f} | "
           f"{rat['compress_before_rss']:.2f} |"] if "compress_before" in med else []),
        *([f"| `taskset -c 0 jaxguard compress` (one core) | {med['compress_1core']['seconds']:.2f} | "
           f"{rat['compress_1core_time']:.2f} | {mib(med['compress_1core']['peak_rss']):.0f} | "
           f"{rat['compress_1core_rss']:.2f} |"] if "compress_1core" in med else []),
        *([f"| `jaxguard restore` before (`--before` checkout) | {med['restore_before']['seconds']:.2f} | "
           f"{rat['restore_before_time']:.2f} | {mib(med['restore_before']['peak_rss']):.0f} | "
           f"{rat['restore_before_rss']:.2f} |"] if "restore_before" in med else []),
        *([f"| `jaxguard compress --codec {w['also_codec']}` | {med['compress_also']['seconds']:.2f} | "
           f"{rat['compress_also_time']:.2f} | {mib(med['compress_also']['peak_rss']):.0f} | "
           f"{rat['compress_also_rss']:.2f} |"] if "compress_also" in med else []),
        *([f"| `jaxguard restore` of a `--codec {w['also_codec']}` file | {med['restore_also']['seconds']:.2f} | "
           f"{rat['restore_also_time']:.2f} | {mib(med['restore_also']['peak_rss']):.0f} | "
           f"{rat['restore_also_rss']:.2f} |"] if "restore_also" in med else []),
        "",
        *([f"{res.get('codec')} against {w['also_codec']}, same run: "
           + (f"compress {rat['compress_vs_also']:.3f}x, " if "compress_vs_also" in rat else "")
           + f"restore {rat['restore_vs_also']:.3f}x its time (median of the per-repeat ratios "
           f"{rat['restore_vs_also_pairwise']:.3f}x); payload {100 * sm['payload_ratio']:.3f}% against "
           f"{100 * w['also_summary']['payload_ratio']:.3f}% of FP32.", ""] if "restore_also" in med else []),
        *([f"The `--before` checkout's restore of the same {res.get('codec')} file against the {w['also_codec']} "
           f"restore: {rat['restore_before_vs_also']:.3f}x (per-repeat median "
           f"{rat['restore_before_vs_also_pairwise']:.3f}x).", ""] if "restore_before_vs_also" in rat else []),
        *([f"Against the durable plain save: compress {rat['compress_vs_durable_plain']:.2f}x, restore "
           f"{rat['restore_vs_durable_plain']:.2f}x (jaxguard fsyncs both before it renames).", ""]
          if "compress_vs_durable_plain" in rat else []),
        *(["Every timed process started after an untimed `os.sync()` (`--sync-between`): none inherits the "
           "previous one's dirty page cache.", ""] if w.get("sync_between") else []),
        *([f"Compress on all {res['machine']['cpus']} cores vs one core: {rat['cores_speedup']:.2f}x faster.", ""]
          if "cores_speedup" in rat else []),
        *([f"The restored files of both restores load to the same tensors, bit for bit: "
           f"{w['restored_identical_to_before']}.", ""] if "restored_identical_to_before" in w else []),
        *([f"Both compresses wrote the same payload and decoded SHA-256: "
           f"{w['container_hashes_identical_to_before']}.", ""] if "container_hashes_identical_to_before" in w else []),
        "Per repeat (" + ", ".join(f"{k}/plain" for k in w["per_repeat_time_ratios"][0]) + "): " + ", ".join(
            "/".join(f"{v:.2f}" for v in x.values()) for x in w["per_repeat_time_ratios"]) + ".",
        "",
        (f"Cold first compress (empty cache: variant detection + XLA compilation): "
         f"{w['cold_compress']['seconds']:.1f} s. Second fresh process: {w['second_run']['programs']} programs, "
         f"{w['second_run']['persistent_cache_hits']} read from the persistent cache, "
         f"{w['second_run']['compiled_anew']} compiled anew; variant detection warning printed: "
         f"{w['second_run']['variant_detection_warning']}; torch imported: "
         f"{w['second_run'].get('torch_imported', 'not recorded')}." if w.get("cold_compress") else
         "No cold compress (--no-cold): the persistent XLA / export caches were warm."),
        "",
        f"Result: {sm['escapes']:,} escapes ({100 * sm['escape_rate']:.4f}%), payload {100 * sm['payload_ratio']:.3f}% "
        f"of FP32, container {w['container_bytes']:,} bytes ({100 * w['container_bytes'] / w['source_bytes']:.1f}% of "
        f"the {w['source_bytes']:,}-byte torch file).",
        ""]
    if not s:
        with open(path, "w") as fh:
            fh.write("\n".join(lines))
        return
    lines += [
        "## In-process encode throughput vs size (trained state tiled)",
        "",
        "| coordinates | seconds | M coords/s | encode alone, s | M coords/s | first pass, s | closed-form tier | "
        "escapes | payload/FP32 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
        enc = (f"{r['encode_seconds']:.2f} | {r['encode_coords_per_s'] / 1e6:.2f} | {r['first_seconds']:.2f}"
               if "encode_seconds" in r else "- | - | -")
        lines.append(f"| {r['coordinates']:,} | {r['seconds']:.2f} | {r['coords_per_s'] / 1e6:.2f} | {enc} | "
                     f"{100 * r['certified_fast'] / max(1, r['coordinates'] - r['exact']):.2f}% | {r['escapes']:,} | "
                     f"{100 * r['payload_ratio']:.3f}% |")
    lines += ["", "Each size is encoded twice in one process and the second pass is timed (the first compiles "
              "the slab shapes no earlier size had); seconds = `state_records` + `writer.container_entries`, encode alone = "
              "`writer.container_entries`.", "",
              f"Least-squares slope {s['slope_s_per_coord'] * 1e9:.1f} ns per coordinate "
              f"({1 / s['slope_s_per_coord'] / 1e6:.2f} M coords/s), intercept {s['intercept_s']:.2f} s, largest "
              f"relative residual {100 * s['max_rel_residual']:.1f}%."
              + (f" Encode alone: {s['encode_slope_s_per_coord'] * 1e9:.1f} ns per coordinate "
                 f"({1 / s['encode_slope_s_per_coord'] / 1e6:.2f} M coords/s)." if "encode_slope_s_per_coord" in s
                 else ""), ""]
    with open(path, "w") as fh:
        fh.write("\n".join(lines))


if __name__ == "__main__":
    main()
