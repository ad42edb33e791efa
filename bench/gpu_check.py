"""The one prepared GPU check (a few minutes of GPU time); on a CPU it runs its simulation parts.

    PYTHONPATH=$PWD python bench/gpu_check.py [--n 4194304] [--out bench/results/gpu.md]

Parts (each says whether it ran on a GPU):

1. simulations (always, CPU): every CUDA op model's `torch_compat.gpu_sim` simulation on
   ``--n`` coordinates with edge magnitudes (FLT_MAX-ish, subnormal, zero), FMA on and
   off, and how many coordinates the contraction changes;
2. replay (GPU): the real torch CUDA kernels (single-tensor, foreach with capturable off
   and on, fused; Adam and AdamW) on the same ``--n`` coordinates, compared bit for bit
   with the simulation (``approx="nearest"``, FMA on and off): a kernel matches if one
   contraction choice gives 0 mismatches in p, m and v; the fused kernel is compared with
   both generations (the probe that confirms which one this torch runs);
3. torch audit (GPU): a small model trained on CUDA with the default Adam (foreach) and
   AdamW (fused=True), saved with `torch_compat.save` (the op model resolved for CUDA),
   loaded into a fresh CUDA optimizer, then the real CUDA step from both states for a
   grid of gradients in ``[-clip, clip]``: max ``|p1 - p2| / lr`` must be ``<= tau``;
4. optax audit (GPU): optax Adam state on the GPU encoded with `jit_encode.encode_jit`
   against ``optax-adam-gpu``, the real jitted optax update on the GPU from both states;
5. PTX facts (GPU): XLA's PTX for the jitted optax update (``--xla_dump_to``): counts of
   ``div.full.f32``, ``div.rn.f32``, ``fma.rn.f32``, ``sqrt.rn.f32``/``sqrt.approx``;
6. throughput (GPU): jitted encode on the device (coordinates per second) beside
   ``torch.save`` of the same state and `torch_compat.save` of it from CUDA tensors on
   both encoder routes: the device route (DLPack into JAX's GPU backend, guarded on the
   GPU by `jaxguard.core.device_encode`; only codes, parameters and escapes cross) and
   the host route (host slabs); the device-route save is repeated with JAX's transfer
   guards at "disallow" (it must make no implicit transfer: a failure otherwise).

Part 3 also checks the restore paths: the load into the CUDA optimizer is silent, the
load into a CPU one warns once (`JaxguardWarning`), the restored moments are on the
parameters' device, and which route (`torch_compat.state.encoder_view`) the CUDA
tensors took.  Part 4 also saves the GPU state with `jaxguard.save` (no ``op_model``:
it must pick ``optax-adam-gpu`` from the arrays' platform), loads it back on the GPU
without a warning and audits that state too.

Nothing here has run on a GPU yet (docs/gpu.md).  Exit code 1 if a GPU part ran and failed.
"""
from __future__ import annotations

import argparse
import copy
import glob
import io
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # torch and jax share the GPU

F = np.float32
DEVICE = "cuda"      # --dry-run-on-cpu: "cpu", to exercise the GPU parts' code (not a measurement)
TORCH_CASES = [  # (label, optimizer class, flags, op model)
    ("Adam single-tensor", "Adam", dict(foreach=False), "torch-adam-cuda"),
    ("Adam foreach (default)", "Adam", dict(), "torch-adam-cuda-foreach"),
    ("Adam foreach capturable", "Adam", dict(foreach=True, capturable=True), "torch-adam-cuda-foreach-capturable"),
    ("AdamW foreach (default)", "AdamW", dict(weight_decay=0.01), "torch-adamw-cuda-foreach"),
    ("Adam fused", "Adam", dict(fused=True), None),
    ("AdamW fused", "AdamW", dict(fused=True, weight_decay=0.01), None),
]


def edge_inputs(n, seed=0):
    """p, g, m, v with edge magnitudes: a spread of normal values, 1% near FLT_MAX-ish
    limits for v and g, 1% subnormal, 1% zeros."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n) * np.exp(rng.uniform(-30, 3, n))
    m = rng.standard_normal(n) * np.exp(rng.uniform(-30, 0, n))
    v = np.exp(rng.uniform(-60, 5, n))
    p = rng.standard_normal(n) * np.exp(rng.uniform(-10, 5, n))
    k = max(1, n // 100)
    v[:k] = np.exp(rng.uniform(150, 176, k))            # near FLT_MAX (~e^88.7 squared-ish)
    g[k:2 * k] = rng.uniform(1e18, 1e19, k)             # g*g near 1e37
    for x in (g, m, v, p):
        x[2 * k:3 * k] = rng.uniform(2.0**-149, 2.0**-126, k) * rng.choice([-1, 1], k)
        x[3 * k:4 * k] = 0.0
    v = np.abs(v)
    return tuple(np.clip(x, -3.4e38, 3.4e38).astype(F) for x in (p, g, m, v))


def part_simulations(n, lines):
    from jaxguard.core.opmodel import GPU_OP_MODELS
    from torch_compat.gpu_sim import simulate_step
    p, g, m, v = edge_inputs(n)
    lines.append(f"## 1. Simulations (CPU, {n:,} coordinates with edge magnitudes)\n")
    lines.append("| op model | seconds (FMA on) | coordinates where FMA changes p, m or v |\n|---|---|---|")
    for name in GPU_OP_MODELS:
        t0 = time.perf_counter()
        on = simulate_step(name, p, g, m, v, step=99, lr=1e-3, weight_decay=0.01, fma=True)
        dt = time.perf_counter() - t0
        off = simulate_step(name, p, g, m, v, step=99, lr=1e-3, weight_decay=0.01, fma=False)
        differ = np.zeros(n, bool)
        for a, b in zip(on, off):
            differ |= ~((a == b) | (np.isnan(a) & np.isnan(b)))
        lines.append(f"| {name} | {dt:.2f} | {int(differ.sum()):,} |")
    lines.append("")


def _same(a, b):
    return (a == b) | (np.isnan(a) & np.isnan(b))


def part_replay(n, lines, torch):
    """Real CUDA kernels vs the simulations (GPU only)."""
    from torch_compat.gpu_sim import simulate_step
    import torch_compat.state as st
    p, g, m, v = edge_inputs(n, seed=1)
    step, lr = 99, 1e-3
    failed = False
    dev = torch.device(DEVICE)

    def foreach_pow(base, exponent):    # capturable: torch._foreach_pow(beta, steps) on the device
        return torch._foreach_pow(base, [torch.tensor(exponent, dtype=torch.float32, device=dev)])[0].item()

    def tensor_pow(base, exponent):     # fused: powf(float beta, float step) in the kernel
        return torch.pow(torch.tensor(base, dtype=torch.float32, device=dev),
                         torch.tensor(exponent, dtype=torch.float32, device=dev)).item()
    lines.append(f"## 2. Bit-exact replay of the CUDA kernels ({n:,} coordinates, torch {torch.__version__})\n")
    lines.append("| kernel | resolved op model | mismatches p/m/v, FMA on | FMA off | matched |\n|---|---|---|---|---|")
    for label, cls, flags, name in TORCH_CASES:
        param = torch.nn.Parameter(torch.from_numpy(p.copy()).to(dev))
        if DEVICE == "cpu" and flags.get("capturable"):
            lines.append(f"| {label} | (dry run: torch refuses capturable on CPU) | | | |")
            continue
        opt = getattr(torch.optim, cls)([param], lr=lr, **flags)
        on_device = flags.get("capturable") or flags.get("fused")
        opt.state[param] = {"step": torch.tensor(float(step), device=dev if on_device else "cpu"),
                            "exp_avg": torch.from_numpy(m.copy()).to(dev),
                            "exp_avg_sq": torch.from_numpy(v.copy()).to(dev)}
        param.grad = torch.from_numpy(g.copy()).to(dev)
        opt.step()
        got = [param.detach().cpu().numpy(), opt.state[param]["exp_avg"].cpu().numpy(),
               opt.state[param]["exp_avg_sq"].cpu().numpy()]
        group = opt.param_groups[0]
        try:
            resolved = st.op_model_of(group, "cuda")
        except Exception as exc:   # noqa: BLE001 - e.g. a torch whose fused generation is unknown: probe both
            resolved, note = None, str(exc)
            lines.append(f"(resolution refused: {note}; probing both fused generations)")
        base = ("torch-adamw" if cls == "AdamW" else "torch-adam") + "-cuda-fused"
        candidates = [name] if name else [base + "-f64", base + "-f32"]
        matched, cells = None, []
        for cand in candidates:
            row = []
            for fma in (True, False):
                pow_fn = foreach_pow if "capturable" in cand else tensor_pow if "fused" in cand else None
                cells_fma = []
                for recip in ((False, True) if "foreach" in cand else (False,)):
                    sim = simulate_step(cand, p, g, m, v, step=step, lr=lr,
                                        weight_decay=flags.get("weight_decay", 0.0), fma=fma, pow_fn=pow_fn,
                                        recip=recip)
                    mis = [int((~_same(a, b)).sum()) for a, b in zip(got, sim)]
                    cells_fma.append("/".join(map(str, mis)) + (" (recip)" if recip else ""))
                    if sum(mis) == 0 and matched is None:
                        matched = f"{cand} (FMA {'on' if fma else 'off'}{', reciprocal' if recip else ''})"
                row.append("; ".join(cells_fma))
            cells.append((cand, row))
        for cand, row in cells:
            lines.append(f"| {label} | {cand}{' (resolved)' if cand == resolved else ''} | {row[0]} | {row[1]} | "
                         f"{matched or 'NO'} |")
        # the kernel matched, and the model torch's flags resolve to is the one that matched
        failed |= matched is None or (resolved is not None and not matched.startswith(resolved + " "))
    lines.append("")
    return failed


def _train(torch, cls, flags, dev, steps=20):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(dev)
    opt = getattr(torch.optim, cls)(model.parameters(), lr=1e-3, **flags)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(64, 256, device=dev)).square().mean().backward()
        opt.step()
    return model, opt


def _route(x):
    """How `torch_compat.state.encoder_view` handed a tensor to the encoder."""
    import jax
    if isinstance(x, jax.Array):
        return f"DLPack, jax.Array on {', '.join(sorted(d.platform for d in x.devices()))}"
    return "host slabs (HostTensor)"


def part_torch_audit(lines, torch, tau=0.01, clip=0.2):
    import warnings
    import torch_compat
    from jaxguard.errors import JaxguardWarning
    from torch_compat.state import encoder_view
    failed = False
    dev = torch.device(DEVICE)
    lines.append("## 3. Real CUDA torch audit of a guarded checkpoint\n")
    lines.append("| optimizer | certified op model | escape rate | max gap / lr | over tau | warnings (same, CPU) "
                 "| encoder route | restored on device |\n|---|---|---|---|---|---|---|---|")
    tiny = clip * 2.0 ** -np.arange(1, 30)
    grid = np.concatenate([np.linspace(-clip, clip, 17), tiny, -tiny])
    for cls, flags in (("Adam", {}), ("AdamW", dict(fused=True, weight_decay=0.01))):
        model, opt = _train(torch, cls, flags, dev)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "state.jg")
            summary = torch_compat.save(path, opt, device_encode=True if DEVICE == "cpu" else None)
            entries_route = _entry_routes(path)
            _, header = torch_compat.restore_tree(path)
            model2, opt2 = _train(torch, cls, flags, dev, steps=0)
            model2.load_state_dict(model.state_dict())
            with warnings.catch_warnings(record=True) as same:     # resumes on the certified kernel: silent
                warnings.simplefilter("always", JaxguardWarning)
                torch_compat.load(path, opt2)
            _, opt_cpu = _train(torch, cls, flags, "cpu", steps=0)
            with warnings.catch_warnings(record=True) as other:    # onto the CPU kernel: one warning
                warnings.simplefilter("always", JaxguardWarning)
                torch_compat.load(path, opt_cpu)
        warned = (sum(issubclass(w.category, JaxguardWarning) for w in same),
                  sum(issubclass(w.category, JaxguardWarning) for w in other))
        route = f'{_route(encoder_view(next(iter(opt.state.values()))["exp_avg"]))}; encoded: {entries_route}'
        on_device = all(st["exp_avg"].device.type == dev.type for st in opt2.state.values())
        worst, over = 0.0, 0
        base = {k: t.detach().clone() for k, t in model.state_dict().items()}
        sd1, sd2 = copy.deepcopy(opt.state_dict()), copy.deepcopy(opt2.state_dict())   # step() updates in place
        for gv in grid:
            outs = []
            for mdl, o, sd in ((model, opt, sd1), (model2, opt2, sd2)):
                mdl.load_state_dict(base)
                o.load_state_dict(sd)
                for prm in mdl.parameters():
                    prm.grad = torch.full_like(prm, float(gv))
                o.step()
                outs.append(torch.cat([prm.detach().reshape(-1) for prm in mdl.parameters()]).cpu().numpy())
            gap = np.abs(outs[0].astype(np.float64) - outs[1].astype(np.float64)) / 1e-3
            worst = max(worst, float(gap.max()))
            over += int((gap > tau).sum())
        lines.append(f"| {cls} {flags or '(defaults)'} | {header['op_model']} | {summary['escape_rate']:.4f} | "
                     f"{worst:.3g} | {over} | {warned[0]}, {warned[1]} | {route} | {on_device} |")
        failed |= over > 0 or warned != (0, 1) or not on_device
    lines.append("")
    return failed


def part_optax(n, lines, tau=0.01, clip=0.2):
    import jax
    import jax.numpy as jnp
    import optax
    from jaxguard.core.config import GuardConfig
    from jaxguard.core.jit_encode import decode_jit, encode_jit
    lines.append(f"## 4. optax on the GPU ({jax.devices()[0]}), encoded on the device against optax-adam-gpu\n")
    tx = optax.adam(1e-3)
    rng = np.random.default_rng(2)
    params = jnp.asarray(rng.standard_normal(n).astype(F))
    state = tx.init(params)

    @jax.jit
    def train(state, params, g):
        u, state = tx.update(g, state, params)
        return state, optax.apply_updates(params, u)
    for i in range(10):
        state, params = train(state, params, jnp.asarray((rng.standard_normal(n) * 0.05).astype(F)))
    adam = state[0]
    cfg = GuardConfig(lr=1e-3, step=int(adam.count), tau=tau, clip=clip, op_model="optax-adam-gpu")
    t0 = time.perf_counter()
    je = encode_jit(adam.mu, adam.nu, params, cfg, capacity=n)
    mt, vt = decode_jit(je)
    jax.block_until_ready(mt)
    enc_s = time.perf_counter() - t0
    restored = (adam._replace(mu=mt, nu=vt),) + tuple(state[1:])

    def gaps(restored):
        worst, over = 0.0, 0
        for gv in np.concatenate([np.linspace(-clip, clip, 17), clip * 2.0 ** -np.arange(1, 30)]):
            g = jnp.full((n,), F(gv))
            p1 = train(state, params, g)[1]
            p2 = train(restored, params, g)[1]
            gap = np.abs(np.asarray(p1, np.float64) - np.asarray(p2, np.float64)) / 1e-3
            worst, over = max(worst, float(gap.max())), over + int((gap > tau).sum())
        return worst, over
    worst, over = gaps(restored)
    esc = int(je.arrays["escape_count"])
    lines.append(f"{n:,} coordinates: escapes {esc:,}; max gap / lr {worst:.3g}; over tau {over}; first encode+decode "
                 f"(with compile) {enc_s:.2f} s\n")
    # the file path: jaxguard.save picks the XLA:GPU model from the arrays' platform, load is silent on the GPU
    import warnings
    import jaxguard as jg
    from jaxguard.errors import JaxguardWarning
    from jaxguard.format import container
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "optax.jg")
        t0 = time.perf_counter()
        summary = jg.save(path, state, params, lr=1e-3, tau=tau, clip=clip)
        save_s = time.perf_counter() - t0
        model = container.read(path, verify_decoded=False)[0].get("op_model")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always", JaxguardWarning)
            loaded = jg.load(path, tx.init(params))
    warned = sum(issubclass(x.category, JaxguardWarning) for x in w)
    worst2, over2 = gaps(loaded)
    lines.append(f"jaxguard.save of the GPU state: op model {model} (chosen from the arrays' platform; want "
                 f"optax-adam-gpu), escape rate {summary['escape_rate']:.4f}, {save_s:.2f} s with compile; "
                 f"jaxguard.load onto the GPU: {warned} warnings; max gap / lr {worst2:.3g}; over tau {over2}\n")
    return over > 0 or over2 > 0 or warned > 0 or model != "optax-adam-gpu", (tx, state, params, cfg)


def part_ptx(lines):
    code = ("import jax, jax.numpy as jnp, optax\n"
            "tx = optax.adam(1e-3); p = jnp.ones(1 << 20); s = tx.init(p)\n"
            "f = jax.jit(lambda s, p, g: optax.apply_updates(p, tx.update(g, s, p)[0]))\n"
            "f(s, p, p).block_until_ready()\n")
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={d}")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
        text = "".join(open(f).read() for f in glob.glob(os.path.join(d, "*.ptx")))
    counts = {k: len(re.findall(re.escape(k), text)) for k in
              ("div.full.f32", "div.rn.f32", "div.approx.f32", "rcp.rn.f32", "fma.rn.f32", "sqrt.rn.f32",
               "sqrt.approx.f32", "rsqrt.approx.f32", "ex2.approx", "lg2.approx")}
    lines.append("## 5. PTX of XLA's optax update\n")
    lines.append(", ".join(f"`{k}`: {v}" for k, v in counts.items()) + "\n")


def _entry_routes(path):
    """The encoder routes the moments entries of a container record ("device" or "host")."""
    from jaxguard.format import container
    header = container.read(path, verify_decoded=False)[0]
    return ", ".join(sorted({e["stats"].get("route", "host") for e in header["entries"] if e["kind"] == "moments"}))


def _guarded_transfers(fn):
    """Run `fn` with JAX's host-to-device and device-to-host transfer guards at "disallow"
    (explicit device_put/device_get stay allowed); returns "none implicit" or the refusal."""
    import jax
    keys = ("jax_transfer_guard_host_to_device", "jax_transfer_guard_device_to_host")
    before = [getattr(jax.config, k) for k in keys]
    for k in keys:
        jax.config.update(k, "disallow")
    try:
        fn()
        return "none implicit"
    except Exception as exc:   # noqa: BLE001 - reported
        return f"refused: {str(exc).splitlines()[0][:120]}"
    finally:
        for k, b in zip(keys, before):
            jax.config.update(k, b)


def part_throughput(n, lines, torch, optax_bits):
    import jax
    from jaxguard.core.jit_encode import encode_jit
    tx, state, params, cfg = optax_bits
    adam = state[0]
    encode_jit(adam.mu, adam.nu, params, cfg, capacity=n).arrays["m_codes"].block_until_ready()
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        je = encode_jit(adam.mu, adam.nu, params, cfg, capacity=n)
    jax.block_until_ready(je.arrays["m_codes"])
    rate = reps * n / (time.perf_counter() - t0)
    sd = {"exp_avg": torch.from_numpy(np.asarray(adam.mu)).to(DEVICE),
          "exp_avg_sq": torch.from_numpy(np.asarray(adam.nu)).to(DEVICE)}
    t0 = time.perf_counter()
    buf = io.BytesIO()
    torch.save(sd, buf)
    save_s = time.perf_counter() - t0
    # torch_compat.save of the same CUDA state on both encoder routes, each after a warm-up:
    # the device route (CUDA tensors through DLPack, guarded on the GPU; forced onto CPU
    # arrays in a dry run) and the host route (host slabs, guard.encode_many)
    import torch_compat
    from torch_compat.state import encoder_view
    prm = torch.nn.Parameter(torch.from_numpy(np.asarray(params)).to(DEVICE))
    opt = torch.optim.Adam([prm], lr=1e-3)
    opt.state[prm] = {"step": torch.tensor(float(adam.count)), **sd}
    route = _route(encoder_view(sd["exp_avg"]))
    device_route = True if DEVICE == "cpu" else None
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for label, de in (("device route", device_route), ("host route", False)):
            torch_compat.save(os.path.join(d, "warm.jg"), opt, device_encode=de)
            t0 = time.perf_counter()
            guarded = torch_compat.save(os.path.join(d, "state.jg"), opt, device_encode=de)
            dt = time.perf_counter() - t0
            rows.append(f"| torch_compat.save, {label} | {_entry_routes(os.path.join(d, 'state.jg'))} | {dt:.3f} | "
                        f"{n / dt:,.0f} | {guarded['container_bytes']:,} | {guarded['escapes']:,} |")
        transfers = _guarded_transfers(lambda: torch_compat.save(os.path.join(d, "g.jg"), opt,
                                                                 device_encode=device_route))
    lines.append("## 6. Throughput on the GPU\n")
    lines.append(f"jitted encode (`encode_jit`, one tensor): {rate:,.0f} coordinates/s ({n:,} coordinates, {reps} "
                 f"calls after one warm-up). CUDA tensors reach JAX by: {route}.\n")
    lines.append("| what | entries' route | seconds | coordinates/s | bytes | escapes |\n|---|---|---|---|---|---|")
    lines.append(f"| torch.save of the two CUDA moments | - | {save_s:.3f} | {n / save_s:,.0f} | {buf.tell():,} | - |")
    lines += rows
    lines.append(f"\nImplicit JAX transfers during the device-route save (transfer guards at disallow): {transfers}"
                 + (" (on the CPU the device-to-host guard does not fire; this checks host-to-device only)"
                    if DEVICE == "cpu" else "") + "\n")
    return not transfers.startswith("none")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 22)
    ap.add_argument("--out", default=None, help="markdown report (default: print only)")
    ap.add_argument("--dry-run-on-cpu", action="store_true",
                    help="run the GPU parts' code on CPU tensors to check the script itself (mismatches expected; "
                         "not a measurement)")
    a = ap.parse_args(argv)
    global DEVICE
    import torch
    lines = ["# bench/gpu_check.py", ""]
    cuda = torch.cuda.is_available()
    try:
        import jax
        jax_gpu = any(d.platform == "gpu" for d in jax.devices())
    except Exception:    # noqa: BLE001 - report, do not fail, on a machine without jax's GPU plugin
        jax_gpu = False
    if a.dry_run_on_cpu:
        DEVICE, cuda, jax_gpu = "cpu", True, True
        lines.append("**DRY RUN ON CPU: the GPU parts run on CPU tensors to check the script; nothing below is a GPU "
                     "measurement and replay mismatches are expected.**\n")
    lines.append(f"torch {torch.__version__}, CUDA available: {cuda}"
                 + (f" ({torch.cuda.get_device_name()})" if cuda and DEVICE == "cuda" else "")
                 + f"; JAX GPU backend: {jax_gpu}\n")
    part_simulations(a.n if cuda and not a.dry_run_on_cpu else min(a.n, 1 << 20), lines)
    failed = False
    if cuda:
        failed |= part_replay(a.n, lines, torch)
        failed |= part_torch_audit(lines, torch)
    else:
        lines.append("**GPU parts 2 (CUDA replay) and 3 (CUDA torch audit) did not run: no CUDA device.**\n")
    if a.dry_run_on_cpu:
        failed = False        # a dry run checks that the code runs, not the numbers
    if jax_gpu:
        bad, bits = part_optax(a.n, lines)
        failed |= bad
        part_ptx(lines)
        if cuda:
            failed |= part_throughput(a.n, lines, torch, bits)
    else:
        lines.append("**GPU parts 4 (optax audit on the GPU), 5 (PTX facts) and 6 (encode throughput) did not run: "
                     "JAX has no GPU backend here.**\n")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 1 if failed and not a.dry_run_on_cpu else 0


if __name__ == "__main__":
    sys.exit(main())
