"""Multi-process JAX scale bench: sharded jaxguard.save/load vs orbax StandardSave/Restore.

    python bench/jax_scale.py [--rows 4096] [--cols 4096] [--emb 8192] [--procs 2] [--devices 4] [--out DIR]

Two processes x four CPU devices each (jax.distributed on localhost, gloo collectives),
an optax adamw state over a global (2, 4) mesh: a kernel [rows, cols] split over both
axes and an embedding [emb, 512] split over "model" and replicated over "data" (so the
de-duplicated share matters), >= 20M Adam coordinates by default.  The moments come from
3 jitted adamw steps on random-normal gradients.

Each measured operation runs in its own pair of processes (so that each process's peak
RSS, `ru_maxrss`, belongs to that operation): orbax `StandardCheckpointer` save, then
`jaxguard.save` (sharded), orbax restore, `jaxguard.load`, both restores into the save's
shardings.  Saves run twice (the first includes XLA compilation of the guard; the
second is warm); restores once.  Times are wall clock of the slowest process, measured
after `block_until_ready` and a barrier.  Results: bench/results/jax_scale.{json,md}.
"""
import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def rss_mb():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(a):
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.devices}"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{a.port}", num_processes=a.procs, process_id=a.pid)
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    sys.path.insert(0, ROOT)
    import jaxguard as jg

    mesh = Mesh(np.array(jax.devices()).reshape(a.procs, -1), ("data", "model"))
    shard = {"w": NamedSharding(mesh, P("data", "model")), "emb": NamedSharding(mesh, P("model", None))}
    shapes = {"w": (a.rows, a.cols), "emb": (a.emb, 512)}
    tx = optax.adamw(1e-3, weight_decay=1e-2)

    def init():
        k = jax.random.PRNGKey(0)
        return {n: jax.random.normal(jax.random.fold_in(k, i), s, jnp.float32) * 0.05
                for i, (n, s) in enumerate(sorted(shapes.items()))}

    params = jax.jit(init, out_shardings={n: shard[n] for n in shapes})()
    abstract = jax.eval_shape(tx.init, params)
    st_sh = jax.tree_util.tree_map_with_path(
        lambda path, x: shard[str(path[-1].key)] if len(x.shape) else NamedSharding(mesh, P()), abstract)
    state = jax.jit(tx.init, out_shardings=st_sh)(params)

    @jax.jit
    def step(p, s, i):
        k = jax.random.fold_in(jax.random.PRNGKey(1), i)
        g = {n: jax.random.normal(jax.random.fold_in(k, j), x.shape) * 0.01 * (1 + j)
             for j, (n, x) in enumerate(sorted(p.items()))}
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step, out_shardings=({n: shard[n] for n in shapes}, st_sh))
    for i in range(3):
        params, state = step(params, state, i)
    jax.block_until_ready((params, state))
    multihost_utils.sync_global_devices("ready")
    base = rss_mb()
    rep = {"pid": a.pid, "mode": a.mode, "rss_before_mb": base, "times": []}
    ocp_dir, jg_dir = os.path.join(a.out, "orbax"), os.path.join(a.out, "jaxguard")
    for rep_i in range(2 if a.mode.endswith("save") else 1):
        multihost_utils.sync_global_devices(f"start{rep_i}")
        t0 = time.perf_counter()
        if a.mode == "orbax_save":
            with ocp.StandardCheckpointer() as ck:
                ck.save(os.path.join(ocp_dir, f"r{rep_i}"), state)
                ck.wait_until_finished()
        elif a.mode == "jg_save":
            s = jg.save(os.path.join(jg_dir, f"r{rep_i}"), state, params, lr=1e-3, weight_decay=1e-2)
            rep["summary"] = {k: s[k] for k in ("coordinates", "escapes", "container_bytes", "total",
                                                "checkpoint_bytes")}
        elif a.mode == "orbax_restore":
            with ocp.StandardCheckpointer() as ck:
                r = ck.restore(os.path.join(ocp_dir, "r1"), jax.tree_util.tree_map(
                    lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), abstract, st_sh))
            jax.block_until_ready(r)
        elif a.mode == "jg_restore":
            r = jg.load(os.path.join(jg_dir, "r1"), state)
            jax.block_until_ready(r)
            same = [bool(np.array_equal(np.asarray(x.addressable_data(0)), np.asarray(y.addressable_data(0))))
                    for x, y in zip(jax.tree_util.tree_leaves(r), jax.tree_util.tree_leaves(state))]
            rep["leaves_bit_equal_to_saved"] = sum(same)
        multihost_utils.sync_global_devices(f"end{rep_i}")
        rep["times"].append(time.perf_counter() - t0)
    rep["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rep["coordinates"] = int(sum(np.prod(s) for s in shapes.values()))
    with open(os.path.join(a.out, f"{a.mode}_{a.pid}.json"), "w") as fh:
        json.dump(rep, fh)


def du(path):
    n = 0
    for d, _, files in os.walk(path):
        n += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--emb", type=int, default=8192)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--out", default="/tmp/jaxguard_jax_scale")
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--mode")
    ap.add_argument("--pid", type=int)
    ap.add_argument("--port", type=int)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    import shutil
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    runs = {}
    for mode in ("orbax_save", "jg_save", "orbax_restore", "jg_restore"):
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--port", str(port), "--out", a.out,
               "--rows", str(a.rows), "--cols", str(a.cols), "--emb", str(a.emb), "--procs", str(a.procs),
               "--devices", str(a.devices)]
        t0 = time.time()
        procs = [subprocess.Popen(cmd + ["--pid", str(i)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for i in range(a.procs)]
        errs = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"{mode} failed:\n" + "\n".join(e[-3000:] for e in errs))
        runs[mode] = [json.load(open(os.path.join(a.out, f"{mode}_{i}.json"))) for i in range(a.procs)]
        print(f"{mode}: {[r['times'] for r in runs[mode]]} ({time.time() - t0:.0f} s with start-up)", flush=True)
    orbax_bytes, jg_bytes = du(os.path.join(a.out, "orbax", "r1")), du(os.path.join(a.out, "jaxguard", "r1"))
    summ = runs["jg_save"][0]["summary"]
    coords = runs["jg_save"][0]["coordinates"]
    rows = []
    for mode, label in (("orbax_save", "orbax StandardSave"), ("jg_save", "jaxguard.save (sharded)"),
                        ("orbax_restore", "orbax StandardRestore"), ("jg_restore", "jaxguard.load (sharded)")):
        rs = runs[mode]
        times = [max(r["times"][i] for r in rs) for i in range(len(rs[0]["times"]))]
        rows.append({"operation": label, "mode": mode, "seconds_cold": times[0],
                     "seconds_warm": times[1] if len(times) > 1 else None,
                     "peak_rss_mb": [r["peak_rss_mb"] for r in rs], "rss_before_mb": [r["rss_before_mb"] for r in rs]})
    try:
        import jax
        import optax
        import orbax.checkpoint as ocp
        versions = {"jax": jax.__version__, "optax": optax.__version__, "orbax": ocp.__version__}
    except Exception:  # noqa: BLE001
        versions = {}
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    load = os.getloadavg()
    res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, shared with other jobs (load average "
                      f"{load[0]:.1f} at the end)", "versions": versions, "commit": commit,
           "processes": a.procs, "devices_per_process": a.devices, "coordinates": coords,
           "shapes": {"w": [a.rows, a.cols], "emb": [a.emb, 512]},
           "bytes_on_disk": {"orbax": orbax_bytes, "jaxguard": jg_bytes}, "jaxguard_summary": summ,
           "per_process_coordinates": [r["summary"]["coordinates"] for r in runs["jg_save"]],
           "restore_leaves_bit_equal": [r.get("leaves_bit_equal_to_saved") for r in runs["jg_restore"]],
           "rows": rows}
    os.makedirs(a.results, exist_ok=True)
    with open(os.path.join(a.results, "jax_scale.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    md = [f"# JAX multi-process scale ({a.procs} processes x {a.devices} CPU devices, {coords:,} Adam coordinates)",
          "", f"Machine: {res['machine']}. Commit {commit}. One run per operation (machine contended: "
          "read the times as an upper bound); saves run twice, cold (with XLA compilation) and warm.", "",
          "| operation | cold s | warm s | peak RSS per process (MB) | RSS before (MB) |", "|---|---:|---:|---|---|"]
    for r in rows:
        warm = f"{r['seconds_warm']:.1f}" if r["seconds_warm"] is not None else "-"
        md.append(f"| {r['operation']} | {r['seconds_cold']:.1f} | {warm} | "
                  f"{', '.join(f'{x:.0f}' for x in r['peak_rss_mb'])} | "
                  f"{', '.join(f'{x:.0f}' for x in r['rss_before_mb'])} |")
    md += ["", f"Bytes on disk: orbax {orbax_bytes:,}, jaxguard {jg_bytes:,} "
           f"({jg_bytes / max(orbax_bytes, 1):.1%}). Escapes {summ['total']['escapes']:,} of "
           f"{summ['total']['coordinates']:,}. Coordinates certified per process: "
           f"{res['per_process_coordinates']} (each its de-duplicated share)."]
    with open(os.path.join(a.results, "jax_scale.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
