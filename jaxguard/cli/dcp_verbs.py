"""`jaxguard compress|restore|inspect|verify` of a ``torch.distributed.checkpoint`` directory.

The verbs' work is `torch_compat.dcp` (`compress_dir`, `restore_dir`, `inspect_dir`,
`verify_dir`); this module turns the parsed arguments into those calls and prints."""
from __future__ import annotations

__all__ = ["run"]

from jaxguard.errors import JaxguardError


def run(verb, a, *, print_summary, print_info) -> int:
    """`jaxguard compress|restore|inspect|verify` when the input is a DCP directory.

    Args:
      verb: ``"compress"``, ``"restore"``, ``"inspect"`` or ``"verify"``.
      a: the parsed CLI arguments.
      print_summary, print_info: the CLI's printers (text or ``--json``).

    Returns:
      The exit status (0, or 1 when verify fails).
    """
    from jaxguard.cli.inputs import guard_spec
    from torch_compat import dcp
    if verb == "compress" and (getattr(a, "lr", None) is not None or getattr(a, "param_order", None) is not None):
        raise JaxguardError("--lr and --param-order apply to a torch.save checkpoint; a DCP directory's moments are "
                            "matched by their fully qualified names and certified at its param groups' lr")
    if verb == "compress":
        s = dcp.compress_dir(a.ckpt, a.output, spec=guard_spec(a), uncertifiable=a.uncertifiable)
        src = dcp.inspect_dir(a.ckpt)["bytes_on_disk"]
        s.update(container_bytes=dcp.inspect_dir(a.output)["bytes_on_disk"], source_bytes=src)
        s["container_ratio"] = s["container_bytes"] / max(src, 1)
        print_summary(s, a.json)
        return 0
    if verb == "restore":
        r = dcp.restore_dir(a.container, a.output)
        print(f"restored {a.container} ({a.input.description}) -> {a.output} (one torch checkpoint: "
              f"{', '.join(r['keys'])})")
        return 0
    if verb == "inspect":
        print_info(dcp.inspect_dir(a.container), a.json)
        return 0
    try:
        res = dcp.verify_dir(a.container)
    except JaxguardError as exc:
        print(f"FAILED {a.container} ({a.input.description}): {exc}")
        return 1
    print(f"ok {a.container} ({a.input.description}): {res['files']} rank files, {res['tensor_chunks']} tensor chunks, "
          f"{res['bytes_items']} bytes items and {res['guarded_shards']} guarded shards match their SHA-256; "
          "decoded moments reproduced")
    return 0
