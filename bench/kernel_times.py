"""Milliseconds per 1M coordinates of the guard's log8-rel programs, one at a time.

    taskset -c 0 python bench/kernel_times.py      # one core
    python bench/kernel_times.py                   # every core the process may use

The state is the trained ByteTransformer of bench/cert_speed.py (867,328 coordinates of
the real ``torch.optim.Adam``), tiled to 1M coordinates.  Each program is jitted, warmed
up, then timed 10 times (median); "numpy inputs" pass host arrays (jax copies them in on
every call unless their data is 64-byte aligned, which `guard._encode_group`'s are since
commit 6e4341c), "device inputs" pass `jax.device_put` arrays.  `encode_many` is the whole guard on that slab (proposal, closed-form tier,
cells, escapes, certified values).  Prints one Markdown table.
"""
from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _median_ms(f, k=10):
    jax.block_until_ready(f())
    ts = []
    for _ in range(k):
        t = time.perf_counter()
        jax.block_until_ready(f())
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def main():
    import cert_speed
    import torch

    from jaxguard.core import bound, certify, codecs, guard
    from jaxguard.core.config import GuardConfig
    jax.config.update("jax_cpu_enable_async_dispatch", False)   # as `jaxguard compress`
    base = cert_speed._base()
    st = base["optimizer"]["state"]
    flat = {k: np.concatenate([s[k].numpy().ravel() for s in st.values()]) for k in ("exp_avg", "exp_avg_sq")}
    params = np.concatenate([p.numpy().ravel() for p in base["model"].values() if p.dtype == torch.float32])
    n = 1 << 20
    m, v, p = (np.resize(x, n).astype(np.float32) for x in (flat["exp_avg"], flat["exp_avg_sq"], params))
    mb, vb, pb = (x.reshape(-1, 256) for x in (m, v, p))
    inside = np.ones(mb.shape, bool)
    aligned = []
    for x in (mb, vb, pb, inside):
        a = guard.aligned_zeros(x.size, x.dtype)
        a[:] = x.reshape(-1)
        aligned.append(a.reshape(x.shape))
    dev = [jax.device_put(x) for x in (mb, vb, pb, inside)]
    masks = jax.jit(certify.device_masks)
    valid, vpos = masks(mb, vb, pb, inside)
    propose = jax.jit(codecs.get("log8-rel").propose)
    out = propose(mb, vb, valid, vpos)
    classify = jax.jit(certify.device_classify)
    cfg = GuardConfig(lr=1e-3, step=61)
    K, _, _, clip = guard._group_constants([(m, v, p, cfg)], np.zeros(n, np.int32), p)
    row = bound.as_step_row(K, -1).as_float32(np)
    row = bound.StepRow(*(x[0] for x in row))
    po = guard._propose_classified(*dev, codec="log8-rel")
    rows = [
        ("block masks (device inputs)", _median_ms(lambda: masks(*dev))),
        ("log8-rel proposal (device inputs)", _median_ms(lambda: propose(dev[0], dev[1], valid, vpos))),
        ("bit classification (device inputs)", _median_ms(lambda: classify(dev[0], dev[1], dev[2], out[4], out[5]))),
        ("`_propose_classified`: the three in one program, device inputs",
         _median_ms(lambda: guard._propose_classified(*dev, codec="log8-rel"))),
        ("`_propose_classified`, numpy inputs", _median_ms(lambda: guard._propose_classified(mb, vb, pb, inside,
                                                                                            codec="log8-rel"))),
        ("`_propose_classified`, numpy inputs aligned to 64 bytes (`guard.aligned_zeros`)",
         _median_ms(lambda: guard._propose_classified(*aligned, codec="log8-rel"))),
        ("`_fast_tier` (closed form), numpy blocks", _median_ms(lambda: guard._fast_tier(
            mb, vb, pb, inside, *po[4:8], row, None, clip.reshape(-1, 256)))),
        ("`guard.encode_many` of the slab (everything)", _median_ms(lambda: guard.encode_many(
            [(m, v, p, cfg)], keep_decoded=True), k=5)),
    ]
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    print(f"| program, 1,048,576 coordinates, {cores} core(s) | ms (median of 10) | ns a coordinate |")
    print("|---|---:|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {ms * 1e6 / n:.1f} |")


if __name__ == "__main__":
    main()
