"""The `jaxguard` command line (also `python -m jaxguard`).

Every error a user can cause prints one line, ``jaxguard: error: ...``, and exits 2.
"""
from __future__ import annotations

__all__ = ["build_parser", "main", "start_cpu_backend_one_thread_pool"]

import argparse
import gc
import json
import os
import sys
import time

from jaxguard import _process_tuning as process_tuning
from jaxguard._process_tuning import start_cpu_backend_one_thread_pool  # noqa: F401 - its documented path
from jaxguard.cli.inputs import param_order
from jaxguard.errors import CheckpointError, JaxguardError, UnsupportedOptimizerError, install_hint

EXIT_USAGE = 2
# the verbs that read or write torch checkpoints or run torch; the rest (inspect, verify
# of a container file) need only numpy
TORCH_VERBS = ("compress", "restore", "audit", "demo", "migrate", "audit-enclosure")
# the verbs that never run jax (restore is torch + the numpy reader): no jax import for them
NUMPY_VERBS = ("restore", "inspect", "verify")


def _die(msg: str) -> int:
    print(f"jaxguard: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _torch_missing(verb: str) -> str | None:
    """The one-line error for ``verb`` when torch is missing, does not import, or is older
    than torch_compat supports, else None."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return f"{verb} needs torch; install it with {install_hint('torch')}"
    return _torch_installed(verb)


def _torch_installed(verb: str) -> str | None:
    """`_torch_missing` without importing torch (compress and restore never do): torch_compat's
    own check, which reads the installed torch's version from its package metadata."""
    try:
        import torch_compat  # noqa: F401
    except ImportError as exc:
        if str(exc).startswith("torch_compat needs torch;"):   # not installed
            return f"{verb} needs torch; install it with {install_hint('torch')}"
        if str(exc).startswith("torch_compat needs torch"):   # too old
            return f"{verb}: {exc}"
        raise
    return None


def load_torch_checkpoint(path, trust=False):
    """`jaxguard.cli.torch_load.load_checkpoint`.

    Args:
      path: a local path or an fsspec URL.
      trust: ``--trust``: a plain ``torch.load`` (else weights-only plus numpy values, RNG
        states and ``argparse.Namespace``).

    Returns:
      The checkpoint object.
    """
    from jaxguard.cli.torch_load import load_checkpoint
    return load_checkpoint(path, trust=trust)


def _print_summary(s, as_json):
    if as_json:
        print(json.dumps(s, sort_keys=True))
        return
    for k in ("input", "coordinates", "escapes", "escape_rate", "payload_bytes", "raw_fp32_bytes", "payload_ratio",
              "container_bytes", "encode_seconds"):
        if k == "input" and k not in s:
            continue
        v = s.get(k)
        print(f"{k:>16}: {v:.6g}" if isinstance(v, float) else f"{k:>16}: {v}")
    if s.get("stored_exactly"):           # --uncertifiable exact: one line naming what and why
        from jaxguard import uncovered
        print(f"{'stored_exactly':>16}: {uncovered.describe(s['stored_exactly'])}")
    if s.get("replay_matched") is False:  # informational: the guard's bound covers every variant
        print(f"{'replay':>16}: no bit-exact torch replay on this machine ({s.get('replay_detail', '')})")


def _cmd_compress(a):
    """``jaxguard compress CKPT -o OUT``: certify and write a container (or a DCP directory)."""
    import torch_compat.state
    from jaxguard.cli.inputs import guard_spec
    from jaxguard.format import storage
    from torch_compat.variant_cache import fast_record, variant_record
    ckpt = None
    if not storage.is_url(a.ckpt) and fast_record() is not None:   # torch is never imported
        from jaxguard.format import torchzip
        try:
            ckpt = torchzip.load(storage.local_path(a.ckpt))
        except torchzip.Unsupported:
            pass   # torch.load decides
    if ckpt is None:
        ckpt = load_torch_checkpoint(a.ckpt, a.trust)
    _refuse_optimizer_alone(a.ckpt, ckpt)
    # the imports' and the tree's objects live to the end: later collections skip them
    # (full collections walked them: 1% of a GPT-2 compress's CPU)
    gc.freeze()
    # the checkpoint is ours and read-only: drop its mapped pages as the stream is done with them
    source = None if storage.is_url(a.ckpt) else torch_compat.state.MappedSource(storage.local_path(a.ckpt))
    summary = torch_compat.state.compress_checkpoint_to(a.output, ckpt, spec=guard_spec(a), progress=not a.json,
                                                       variant=variant_record, op_model=a.op_model,
                                                       release=source.release if source else None,
                                                       param_order=param_order(a.param_order), lr=a.lr,
                                                       uncertifiable=a.uncertifiable)
    raw = storage.size(a.ckpt)
    summary["source_bytes"] = raw
    summary["container_ratio"] = summary["container_bytes"] / raw
    _print_summary({**_seen(a), **summary}, a.json)
    return 0


def _seen(a) -> dict:
    """The input's kind for a verb's output (``input``, ``input_kind``: `jaxguard.cli.inputs`)."""
    inp = getattr(a, "input", None)
    return {} if inp is None else {"input": inp.description, "input_kind": inp.kind}


def _refuse_optimizer_alone(path, ckpt):
    """One line for an optimizer state_dict saved alone (a trainer's ``optimizer.pt``): its
    moments are certified against weights it does not hold."""
    if not (isinstance(ckpt, dict) and "state" in ckpt and "param_groups" in ckpt and "model" not in ckpt):
        return
    from jaxguard.cli import inputs
    parent = os.path.dirname(os.path.abspath(str(path)))
    try:
        where = inputs.recognise(parent)
    except JaxguardError:
        where = None
    hint = (f"pass the directory it is in ({parent}, {where.description}), whose weights jaxguard compress reads"
            if where is not None and where.kind in ("hf-checkpoint", "accelerate-checkpoint") else
            "save {'model': model.state_dict(), 'optimizer': optimizer.state_dict()} and compress that")
    raise CheckpointError(f"{path} holds an optimizer state_dict alone; its moments are certified against the model "
                          f"weights it does not hold: {hint}")


def next_lr(text: str):
    """``--lr``: the next step's learning rate, ``X`` or ``LO:HI`` (an interval certified
    for every rate in it), or one of those per param group, comma-separated.

    Args:
      text: the option's value.

    Returns:
      A float, a ``(lo, hi)`` tuple, or a list of those (one per param group).

    Raises:
      argparse.ArgumentTypeError: not numbers.
    """
    def one(item):
        parts = item.split(":")
        try:
            vals = [float(x) for x in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a learning rate; pass e.g. 1e-3, 1e-4:1e-3 or "
                                             "1e-3,1e-4 (one per param group)") from None
        if len(vals) > 2:
            raise argparse.ArgumentTypeError(f"{item!r}: an interval is LO:HI")
        return vals[0] if len(vals) == 1 else tuple(vals)

    items = [one(x) for x in text.split(",")]
    return items[0] if len(items) == 1 else items


def _cmd_restore(a):
    """``jaxguard restore OUT -o CKPT2``: a torch checkpoint with the moments decoded.

    Written in torch.save's format without importing torch (`jaxguard.format.torchzip_writer`: the
    same tensors, every check of the reader); a tree it does not cover goes through
    `torch_compat.restore_tree` and torch.save."""
    from jaxguard.format import torchzip_writer
    if not torchzip_writer.restore(a.container, a.output):
        import torch_compat
        from torch_compat.state import save_torch
        tree, _ = torch_compat.restore_tree(a.container)
        save_torch(a.output, tree)
    inp = getattr(a, "input", None)
    print(f"restored {a.container}{f' ({inp.description})' if inp else ''} -> {a.output}")
    return 0


def _cmd_inspect(a):
    """``jaxguard inspect OUT``: header, per-entry stats, what the moments were certified for
    (grouped by update), decoded hash (``--json``: one object)."""
    from jaxguard import audit
    from jaxguard.format import container, spec, storage
    header, payload, tables = container.read(a.container)
    ents = [e for e in header["entries"] if e["kind"] == "moments"]
    uncertified = sum(not spec.entry_certified(e) for e in ents)   # codec registered uncertified, or certify: false
    n = sum(e["stats"]["coordinates"] for e in ents)
    esc = sum(e["stats"]["escapes"] for e in ents)
    pay = sum(e["stats"]["payload_bytes"] for e in ents)
    info = {**{k: v for k, v in _seen(a).items() if k == "input"}, "version": header.get("version")}
    info.update({k: _setting(header, ents, k) for k in ("op_model", "tau", "clip", "codec", "bound", "partition")})
    info["variant"] = header.get("variant")
    info.update({"framework": header["meta"].get("framework"), "entries": len(header["entries"]),
                 "moment_tensors": len(ents), "certified": uncertified == 0,
                 "uncertified": uncertified, "coordinates": n, "escapes": esc, "escape_rate": esc / max(n, 1),
                 "payload_bytes": pay, "raw_fp32_bytes": 8 * n, "payload_ratio": pay / max(8 * n, 1),
                 "container_bytes": storage.size(a.container), "payload_sha256": header["payload_sha256"],
                 "decoded_sha256": header["decoded_sha256"]})
    variant = header.get("variant")
    if isinstance(variant, dict):
        info.update(replay_matched=variant.get("matched"), replay_detail=variant.get("detail", ""))
    info["certified_for"] = audit.certified_for((e.get("config"), e.get("stats")) for e in ents)
    info["stored_exactly"] = _stored_exactly(header["meta"])
    _print_info(info, a.json)
    return 0


def _stored_exactly(meta) -> list:
    """The moments a file stores exactly instead of certifying (next lr 0): ``{"param",
    "why"}`` each (torch: the meta's list; optax: the marked leaves, one per param)."""
    out = list(meta.get("stored_exactly") or [])
    seen = set()
    for leaf in (meta.get("state") or {}).get("leaves") or []:
        if leaf.get("why"):
            parts = leaf["path"].split(".")
            cut = next((i for i, x in enumerate(parts) if x in ("mu", "nu")), -1)
            param = ".".join(parts[cut + 1:])
            if param not in seen:
                seen.add(param)
                out.append({"param": param, "why": leaf["why"]})
    return out


def _setting(header, ents, key):
    """A guard setting for `inspect`: the header's, else the moments entries' own configs
    (some writers record it per entry only): their one value, or "per entry: a, b" when they
    differ; None only when no entry records it either."""
    if header.get(key) is not None:
        return header[key]
    vals = []
    for e in ents:
        v = (e.get("config") or {}).get(key, e.get(key))
        if v is not None and v not in vals:
            vals.append(v)
    if len(vals) > 1:
        return "per entry: " + ", ".join(map(str, vals))
    return vals[0] if vals else None


def _print_info(info, as_json):
    if as_json:
        print(json.dumps(info, sort_keys=True))
        return
    from jaxguard import audit
    for k, v in info.items():
        if k == "certified_for":
            print(f"{k:>16}: {len(v)} update{'s' if len(v) != 1 else ''}" + (":" if v else ""))
            for i, g in enumerate(v, 1):
                print(f"{'':>18}[{i}] {audit.describe_certified(g)}")
        elif k == "stored_exactly":
            if v:
                whys = sorted({x["why"] for x in v})
                print(f"{k:>16}: {len(v)} parameter{'s' if len(v) != 1 else ''} ({'; '.join(whys)})")
        else:
            print(f"{k:>16}: {'not recorded' if v is None else v}")


def _cmd_verify(a):
    """``jaxguard verify OUT``: both SHA-256 and the decoded-moments hash, numpy reader only."""
    from jaxguard.format import integrity, reader, storage
    try:
        data = storage.read_bytes(a.container)
        res = reader.verify_bytes(data)
    except (reader.ReaderError, JaxguardError) as exc:
        print(f"FAILED {_named(a)}: {exc}")
        return 1
    header, _ = reader.parse(data)
    print(f"ok {_named(a)}: file and payload {integrity.hash_label(res['hash'])} match, payload_sha256 {header['payload_sha256']}, "
          f"decoded_sha256 {res['decoded_sha256']} reproduced by the numpy reader")
    return 0


def _named(a) -> str:
    """The verb's input with its kind in words: ``PATH (a jaxguard container file)``."""
    inp = getattr(a, "input", None)
    return f"{a.container} ({inp.description})" if inp is not None else str(a.container)


def _cmd_audit(a):
    """``jaxguard audit CKPT OUT``: the first update with the real torch Adam over a gradient grid."""
    import torch_compat
    from jaxguard.format import spec
    ckpt = load_torch_checkpoint(a.ckpt, a.trust)
    restored, header = torch_compat.restore_tree(a.container)
    tau = header.get("tau") or spec.DEFAULT_TAU
    clip = header.get("clip") or spec.DEFAULT_CLIP
    lr = a.lr if a.lr is not None else _given_lr(header)
    res = torch_compat.audit(ckpt, restored, tau=tau, clip=clip, progress=not a.json,
                             param_order=param_order(a.param_order), lr=lr)
    res.update({"tau": tau, "clip": clip, "passed": res["violations"] == 0})
    if a.json:
        print(json.dumps(res, sort_keys=True))
    else:
        asserted = " (moments matched to weights by the order you asserted)" if a.param_order else ""
        print(f"audit: {res['coordinates']} coordinates x {res['gradients']} gradients, worst gap "
              f"{res['max_gap_lr']:.6g} lr (tau {tau}), {res['violations']} coordinates over tau{asserted}: "
              + ("PASS" if res["passed"] else "FAIL"))
    return 0 if res["passed"] else 1


def _given_lr(header):
    """The learning rate `compress --lr` certified every moment for (the param groups did not
    hold it), so that the audit steps with it; None when the groups' own were certified."""
    cfgs = [e.get("config") or {} for e in header.get("entries", []) if e.get("kind") == "moments"]
    given = {json.dumps(c.get("lr")) for c in cfgs if c.get("source") == "param_groups+given"}
    if len(given) == 1 and all(c.get("source") == "param_groups+given" for c in cfgs):
        lr = json.loads(given.pop())
        return tuple(lr) if isinstance(lr, list) else lr
    return None


def _cmd_migrate(a):
    """``jaxguard migrate CKPT --to optax|torch -o OUT``: move Adam state between frameworks."""
    from torch_compat import migrate
    from torch_compat.state import save_torch
    from jaxguard.format import storage
    from jaxguard.format.container import atomic_write
    is_container = storage.exists(a.ckpt) and storage.read_bytes(a.ckpt)[:8] == b"JAXGUARD"
    if a.to == "optax":
        if is_container:
            import torch_compat
            ckpt, _ = torch_compat.restore_tree(a.ckpt)
        else:
            ckpt = load_torch_checkpoint(a.ckpt, a.trust)
        data, summary = migrate.torch_to_container(ckpt, tau=a.tau, clip=a.clip, codec=a.codec)
        atomic_write(a.output, data)
        _print_summary(summary, a.json)
    else:
        if not is_container:
            raise CheckpointError(f"{a.ckpt} is not a jaxguard container; --to torch reads optax state saved with "
                                  "jaxguard.save(..., include_params=True) or `jaxguard migrate --to optax`")
        save_torch(a.output, migrate.container_to_torch(a.ckpt))
        if a.json:
            print(json.dumps({"output": a.output, "to": "torch"}))
        else:
            print(f"migrated {a.ckpt} -> {a.output} (torch checkpoint: 'model' and 'optimizer')")
    return 0


def _cmd_demo(a):
    """``jaxguard demo``: train the byte transformer, compress (every way with --full), audit, print the table."""
    from jaxguard.cli.demo import run_demo
    rc = run_demo(steps=a.steps, as_json=a.json, full=a.full)
    # the process ends next, and its last collections would walk every object torch, torch._dynamo
    # and JAX made: that exit took 2.5-4.1 s on the loaded 2-core machine, 0.5-0.6 s frozen
    gc.freeze()
    gc.enable()   # `main` turned it off for the demo (a caller in this process keeps collecting)
    return rc


# every kind of input (jaxguard.cli.inputs): the file verbs above, DCP (jaxguard.cli.dcp_verbs),
# JAX and trainer directories (jaxguard.cli.by_kind)
def _by_kind(verb, attr):
    def wrap(fn):
        def run(a):
            from jaxguard.cli import by_kind, inputs
            try:
                a.input = inputs.recognise(getattr(a, attr))
            except JaxguardError as exc:
                if verb != "verify":
                    raise
                print(f"FAILED {exc}")   # (the message starts with the path)
                return 1
            return by_kind.run(verb, a, file_verb=fn, sharded_verb=_jax_sharded_command, torch_missing=_torch_missing,
                               print_summary=_print_summary, print_info=_print_info)
        run.__doc__, run.__name__ = fn.__doc__, fn.__name__
        return run
    return wrap


def _jax_sharded_command(verb, a):
    from jaxguard import sharded
    path = a.container
    if verb == "verify":
        try:
            r = sharded.verify(path)
        except JaxguardError as exc:
            print(f"FAILED {_named(a)}: {exc}")
            return 1
        print(f"ok {_named(a)}: {r['files']} process files and {r['shards']} shards match manifest.json (save "
              f"{r['save_id'] or 'of the older layout'}), each file's SHA-256 and decoded hash checked")
        return 0
    man = sharded.read_manifest(path)
    sharded.check_files(man, path)
    tot = man.get("summary") or {}
    n, esc = tot.get("coordinates", 0), tot.get("escapes", 0)
    info = {**{k: v for k, v in _seen(a).items() if k == "input"},
            **{k: man.get(k) for k in ("version", "op_model", "tau", "clip", "codec", "process_count", "save_id")}}
    info.update({"framework": "optax-sharded", "files": len(man["files"]),
                 "shards": sum(len(v) for v in man["shards"].values()), "leaves": len(man["state"]["leaves"]),
                 "coordinates": n, "escapes": esc, "escape_rate": esc / max(n, 1),
                 "payload_bytes": tot.get("payload_bytes"), "raw_fp32_bytes": 8 * n,
                 "checkpoint_bytes": sum(f["bytes"] for f in man["files"].values())})
    from jaxguard import audit
    shards = [sh["header"] for entry in man["shards"].values() for sh in entry
              if (sh.get("header") or {}).get("kind") == "moments"]
    info["certified_for"] = audit.certified_for((h.get("config"), h.get("stats")) for h in shards)
    info["stored_exactly"] = _stored_exactly(man)
    _print_info(info, a.json)
    return 0


_cmd_compress = _by_kind("compress", "ckpt")(_cmd_compress)
_cmd_restore = _by_kind("restore", "container")(_cmd_restore)
_cmd_inspect = _by_kind("inspect", "container")(_cmd_inspect)
_cmd_verify = _by_kind("verify", "container")(_cmd_verify)


TRUST_HELP = ("load the torch checkpoint with a plain torch.load (weights_only=False: it runs whatever the file names); "
              "only for files you trust. Without it: tensors, numbers, strings, numpy scalars and arrays, RNG states "
              "and argparse.Namespace")


def build_parser():
    """The argparse parser of every verb (imports nothing heavy: each verb imports what it uses).

    Returns:
      An `argparse.ArgumentParser`.
    """
    from jaxguard.format import spec
    p = argparse.ArgumentParser(prog="jaxguard", description="Guarded compression of Adam optimizer state.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compress", help="compress a torch checkpoint's Adam moments")
    c.add_argument("ckpt")
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--tau", type=float, default=spec.DEFAULT_TAU)
    c.add_argument("--clip", type=float, default=spec.DEFAULT_CLIP)
    c.add_argument("--codec", default=spec.DEFAULT_CODEC, choices=spec.codec_ids())
    c.add_argument("--bound", default=spec.DEFAULT_BOUND, choices=["shared", "separate"])
    c.add_argument("--partition", default=spec.DEFAULT_PARTITION, choices=["mixed", "linear"])
    c.add_argument("--json", action="store_true")
    from jaxguard.core.opmodel import OP_MODELS   # numpy only
    torch_models = [m for m in OP_MODELS if m.startswith("torch")]
    c.add_argument("--op-model", default=None, choices=torch_models, metavar="NAME",
                   help="the kernel the run resumes on (default: the state's own, resolved as torch does); one of "
                        + ", ".join(torch_models))
    c.add_argument("--trust", action="store_true", help=TRUST_HELP)
    c.add_argument("--lr", type=next_lr, default=None, metavar="LR",
                   help="the next step's learning rate, if the param groups do not hold it (saved before "
                        "scheduler.step()): X, LO:HI (certified for every rate in it) or one per param group, "
                        "comma-separated; 0 stores those moments exactly")
    c.add_argument("--uncertifiable", default="refuse", choices=["refuse", "exact"],
                   help="state the guard cannot certify (bfloat16/float16 state, amsgrad, an optimizer that is not "
                        "Adam): refuse (default) or store it exactly beside the compressed rest (docs/coverage.md)")
    _add_param_order(c)
    c.set_defaults(fn=_cmd_compress)
    r = sub.add_parser("restore", help="write a torch checkpoint with the moments restored")
    r.add_argument("container")
    r.add_argument("-o", "--output", required=True)
    r.set_defaults(fn=_cmd_restore)
    i = sub.add_parser("inspect", help="header and stats")
    i.add_argument("container")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=_cmd_inspect)
    v = sub.add_parser("verify", help="check both hashes with the numpy-only reader")
    v.add_argument("container")
    v.set_defaults(fn=_cmd_verify)
    au = sub.add_parser("audit", help="first-update audit with the real torch Adam")
    au.add_argument("ckpt")
    au.add_argument("container")
    au.add_argument("--json", action="store_true")
    au.add_argument("--trust", action="store_true", help=TRUST_HELP)
    au.add_argument("--lr", type=next_lr, default=None, metavar="LR",
                    help="step with this learning rate instead of the param groups' (LO:HI: at LO, sqrt(LO HI), HI)")
    _add_param_order(au)
    au.set_defaults(fn=_cmd_audit)
    d = sub.add_parser("demo", help="train a small model, compress, restore, audit")
    d.add_argument("--steps", type=int, default=None, help="training steps (default 40; 150 with --full)")
    d.add_argument("--full", action="store_true", help="every codec the paper compares, a finer audit grid")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=_cmd_demo)
    mg = sub.add_parser("migrate", help="convert Adam/AdamW state between torch and optax")
    mg.add_argument("ckpt")
    mg.add_argument("--to", required=True, choices=["optax", "torch"])
    mg.add_argument("-o", "--output", required=True)
    mg.add_argument("--tau", type=float, default=spec.DEFAULT_TAU)
    mg.add_argument("--clip", type=float, default=spec.DEFAULT_CLIP)
    mg.add_argument("--codec", default=spec.DEFAULT_CODEC, choices=spec.codec_ids())
    mg.add_argument("--json", action="store_true")
    mg.add_argument("--trust", action="store_true", help=TRUST_HELP)
    mg.set_defaults(fn=_cmd_migrate)
    _add_audit_enclosure(sub)
    return p


def _add_param_order(parser):
    parser.add_argument("--param-order", default=None, metavar="model|trainer|FILE",
                        help="an optimizer without param_names (or with stale ones) whose parameters cannot be matched "
                             "to the model by their shapes: assert the order, 'model' (built from model.parameters()), "
                             "'trainer' (a Hugging Face Trainer checkpoint directory: the Trainer's own optimizer, "
                             "weights it decays then the rest) or a file of names in the optimizer's order, one a line")


def _add_audit_enclosure(sub):
    """The ``audit-enclosure`` verb; `torch_compat.enclosure` (jax, torch) is imported only
    when it runs, so building the parser costs no heavy import."""
    from jaxguard.core.opmodel import GPU_OP_MODELS, TORCH_OP_MODELS   # numpy only
    a = sub.add_parser("audit-enclosure", help="check the bound against the bit-exact torch replay")
    a.add_argument("--cases", type=int, default=1048576)
    a.add_argument("--no-radius", action="store_true", help="ideal stage only (the audit must find failures)")
    a.add_argument("--json", action="store_true")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--op-model", default="torch-adam", choices=list(TORCH_OP_MODELS) + list(GPU_OP_MODELS),
                   help="torch Adam/AdamW and its implementation (-foreach: foreach=True, -fused: fused=True on CPU); "
                        "the GPU models (-cuda*, optax-*-gpu) are checked against their CPU simulations")
    a.add_argument("--edge-fraction", type=float, default=0.25,
                   help="share of cases (and adamw groups) drawn at float32's edges")
    a.add_argument("--lr-interval", action="store_true",
                   help="certify every group for an lr interval (hi/lo up to 1000) and replay it at lo, hi or between")
    a.set_defaults(fn=_cmd_audit_enclosure)
    return a


def _cmd_audit_enclosure(a):
    """``jaxguard audit-enclosure``: `torch_compat.enclosure.run`, imported only now.

    Args:
      a: the parsed arguments (cases, no_radius, json, seed, op_model, edge_fraction).

    Returns:
      The exit code of `torch_compat.enclosure.run`.
    """
    from torch_compat import enclosure
    return enclosure.run(a)


def _enable_compile_cache():
    """The CLI is an application: cache XLA executables across runs (~20 s of compiles).

    The directory is named by the jax/jaxlib versions and the machine (jax's own cache
    key adds the backend, XLA flags and compile options), so another install never reads
    a stale entry; every program is cached (min compile time 0).  The guard's own kernels
    come from `jaxguard.core.programs`'s cache, which the library keeps on by default.

    Raises:
      ConfigError: ``JAXGUARD_PROGRAM_CACHE_MB`` is not an integer.
    """
    from jaxguard.core import programs
    programs.enabled()   # reads JAXGUARD_PROGRAM_CACHE_MB: a bad value is one line, before any work
    try:
        import platform
        import jax
        import jaxlib
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        tag = f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-{platform.machine()}"
        jax.config.update("jax_compilation_cache_dir", os.path.join(base, "jaxguard", "xla", tag))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    except Exception:  # noqa: BLE001 - a cache is an optimisation only
        pass




def _one_thread_xla_pool_if_threaded(a):
    """For a compress that will run more than one encode thread: start jax's CPU backend
    with an intra-op pool of one thread (`start_cpu_backend_one_thread_pool`).

    The encode threads are estimated from the source's size (an Adam coordinate takes 12
    bytes at least: p, m, v); a wrong guess costs time, never a result.  With one encode
    thread (below 2**25 coordinates: the 16.5M bench checkpoint) XLA's own pool stays: there
    the two pools measured alike within this machine's noise
    (bench/experiments/results/encode_cores.md).  Nothing changes for a DCP directory or a
    URL."""
    from jaxguard import writer
    from jaxguard.format import storage
    try:
        if storage.is_url(a.ckpt) or not os.path.isfile(a.ckpt):
            return
        guess = os.path.getsize(a.ckpt) // 12 * writer.work_weight(a.codec)
        if writer.encode_threads(guess) < 2:
            return
    except (OSError, JaxguardError):   # a bad setting is reported by the encode
        return
    start_cpu_backend_one_thread_pool()


def main(argv=None) -> int:
    """The ``jaxguard`` console script.

    Args:
      argv: the arguments (default ``sys.argv[1:]``).

    Returns:
      The exit status: 0, or 2 after one ``jaxguard: error: ...`` line on stderr.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    if verb == "demo":   # a short process with little cyclic garbage: its full collections while torch,
        gc.disable()     # torch._dynamo and JAX import walk all their objects (3.0 s of a 37 s loaded run)
    if verb in TORCH_VERBS:   # before parsing: without torch, audit-enclosure's options are unknown
        missing = _torch_installed(verb) if verb in ("restore", "compress") else _torch_missing(verb)
        if missing:
            return _die(missing)
    args = build_parser().parse_args(argv)
    if args.cmd in ("compress", "restore"):
        process_tuning.reuse_freed_memory()
        process_tuning.no_numpy_huge_pages()
    if args.cmd == "compress":        # (restore runs no JAX program: it must not import jax)
        process_tuning.synchronous_cpu_dispatch()   # read when the backend starts: before any program runs
        _one_thread_xla_pool_if_threaded(args)
    try:
        if args.cmd not in NUMPY_VERBS:
            _enable_compile_cache()
        return args.fn(args)
    except UnsupportedOptimizerError as exc:
        fix = "; jaxguard compress --uncertifiable exact stores it exactly" if args.cmd == "compress" else ""
        return _die(f"{exc}{fix}")
    except JaxguardError as exc:
        return _die(str(exc))
    except (OSError, MemoryError) as exc:
        return _die(f"{getattr(exc, 'filename', '') or ''} {exc.strerror if hasattr(exc, 'strerror') and exc.strerror else exc}".strip())
    except KeyboardInterrupt:
        return _die("interrupted; no output file was written")


if __name__ == "__main__":
    sys.exit(main())
