"""`jaxguard compress|restore|inspect|verify` of a Hugging Face Trainer or accelerate
checkpoint directory (`jaxguard.cli.inputs`: ``hf-checkpoint``, ``accelerate-checkpoint``).

* **compress DIR -o OUT**: each optimizer file (``optimizer.pt``; accelerate's
  ``optimizer.bin``, ``optimizer_<i>.bin``) becomes a container (``optimizer.jg``,
  ``optimizer_<i>.jg``: the names `jaxguard.integrations` write and read), certified against
  the model weights beside it (``model.safetensors``, ``pytorch_model.bin``, sharded
  indexes, adapter weights); every other file (weights, scheduler, RNG states, trainer
  state) is copied as it is.  ``GuardedTrainer`` and `jaxguard.integrations.accelerate`
  resume from OUT as it is.
* **restore OUT -o DIR**: the inverse: each ``optimizer*.jg`` decoded back into the file it
  was compressed from (recorded in its meta; a directory the integrations wrote gets the
  framework's own name), every other file copied: the plain Trainer or
  ``Accelerator.load_state`` resumes from DIR.
* **inspect / verify**: the directory's files, and each ``optimizer*.jg`` inspected or
  verified as a container file.

Both writes go to a hidden staging directory beside the output and are published by
rename when complete (`jaxguard.format.storage.commit_directory`): a failed or interrupted
run leaves no half-written directory.
"""
from __future__ import annotations

__all__ = ["run", "load_weights", "trainer_param_order"]

import argparse
import contextlib
import io
import json
import os
import shutil

from jaxguard.errors import CheckpointError, JaxguardError

HF_OPTIMIZER, ACCELERATE_OPTIMIZER = "optimizer.pt", "optimizer.bin"


def run(verb, a, *, file_verb, print_summary, print_info) -> int:
    """`verb` on the trainer directory ``a.input`` (module docstring).

    Args:
      verb: ``"compress"``, ``"restore"``, ``"inspect"`` or ``"verify"``.
      a: the parsed arguments (``a.input`` set).
      file_verb: the verb's function for one container file (inspect, verify).
      print_summary, print_info: the CLI's printers.

    Returns:
      The exit status.

    Raises:
      CheckpointError: (one line) compress of a directory whose optimizer is compressed
        already, restore of one that holds no ``optimizer*.jg``, weights that do not match.
    """
    if verb == "compress":
        return _compress(a, print_summary)
    if verb == "restore":
        return _restore(a)
    return _read(verb, a, file_verb, print_info)


def _jg_files(inp) -> list:
    return [n for n in inp.optimizer_files() if n.endswith(".jg")]


def _plain_files(inp) -> list:
    return [n for n in inp.optimizer_files() if not n.endswith(".jg")]


def compressed_name(name: str) -> str:
    """The container name of a trainer optimizer file.

    Args:
      name: ``optimizer.pt``, ``optimizer.bin``, ``optimizer_1.bin``, ...

    Returns:
      ``optimizer.jg``, ``optimizer_1.jg``, ...
    """
    return name.rsplit(".", 1)[0] + ".jg"


def restored_name(kind: str, name: str, meta: dict) -> str:
    """The file a container is restored to.

    Args:
      kind: the directory's kind (``hf-checkpoint`` or ``accelerate-checkpoint``).
      name: the container's name (``optimizer.jg``, ``optimizer_1.jg``).
      meta: its meta (``source_file``: the file `jaxguard compress` read).

    Returns:
      The file it was compressed from, else the framework's own name for an integration's
      file (``optimizer.pt`` for the Trainer, ``optimizer.bin``/``optimizer_<i>.bin`` for
      accelerate).
    """
    source = meta.get("source_file")
    if isinstance(source, str) and os.path.basename(source) == source and source.startswith("optimizer"):
        return source
    return name.rsplit(".", 1)[0] + (".pt" if kind == "hf-checkpoint" else ".bin")


def load_weights(directory: str) -> dict:
    """The model weights of a trainer checkpoint directory: ``{name: tensor}``.

    Args:
      directory: the checkpoint directory.

    Returns:
      The tensors of ``model.safetensors`` or ``pytorch_model.bin`` (their sharded
      ``*.index.json`` forms too), else of the adapter weights.

    Raises:
      CheckpointError: no weights file (one line naming the names looked for).
    """
    from jaxguard.cli.inputs import WEIGHT_FILES
    for stem in ("model", "pytorch_model", "adapter_model"):
        for name in (f"{stem}.safetensors", f"{stem}.bin"):
            index = os.path.join(directory, name + ".index.json")
            if os.path.isfile(index):
                with open(index) as fh:
                    shards = sorted(set((json.load(fh).get("weight_map") or {}).values()))
                out = {}
                for shard in shards:
                    out.update(_weights_file(os.path.join(directory, shard)))
                return out
            if os.path.isfile(os.path.join(directory, name)):
                return _weights_file(os.path.join(directory, name))
    raise CheckpointError(f"{directory} holds no model weights ({', '.join(WEIGHT_FILES)}); the optimizer's moments "
                          "are certified against them")


def _weights_file(path: str) -> dict:
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CheckpointError(f"{path}: reading safetensors needs the safetensors package (pip install "
                                  "safetensors; it comes with transformers)") from None
        return load_file(path, device="cpu")
    from jaxguard.cli.torch_load import load_checkpoint
    return load_checkpoint(path)


@contextlib.contextmanager
def _staged(output: str):
    """A staging directory beside `output`, published as `output` when the block ends
    without error (replacing a previous directory there), removed otherwise."""
    from jaxguard.format.storage import commit_directory, new_token, staging_path
    final = os.path.normpath(os.fspath(output))
    if os.path.exists(final) and not os.path.isdir(final):
        raise CheckpointError(f"{output} is a file; pass a directory to write the checkpoint directory to")
    token = new_token()
    stage = staging_path(final, token)
    os.makedirs(os.path.dirname(os.path.abspath(stage)), exist_ok=True)
    os.makedirs(stage)
    try:
        yield stage
        commit_directory(stage, final, token)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _copy_others(src: str, stage: str, skip) -> list:
    """Copy every entry of `src` but `skip` into `stage` (directories whole); returns the names."""
    copied = []
    for name in sorted(os.listdir(src)):
        if name in skip:
            continue
        s = os.path.join(src, name)
        if os.path.isdir(s):
            shutil.copytree(s, os.path.join(stage, name))
        else:
            shutil.copy2(s, os.path.join(stage, name))
        copied.append(name)
    return copied


def _compress(a, print_summary) -> int:
    import torch_compat.state as tstate
    from jaxguard import audit, writer
    from jaxguard.cli.inputs import guard_spec
    from jaxguard.cli.torch_load import load_checkpoint
    inp = a.input
    plain = _plain_files(inp)
    if not plain:
        raise CheckpointError(f"{inp.path} is {inp.description} whose optimizer is compressed already "
                              f"({', '.join(_jg_files(inp))}); jaxguard restore writes the uncompressed one back")
    spec = guard_spec(a)
    update = tstate.torch_update_request(lr=a.lr, op_model=a.op_model, uncertifiable=a.uncertifiable)
    weights = load_weights(inp.path)
    totals, written, notes, stored = audit.new_totals(), 0, {}, []
    with _staged(a.output) as stage:
        _copy_others(inp.path, stage, set(plain) | {compressed_name(n) for n in plain})
        for name in plain:
            sd = load_checkpoint(os.path.join(inp.path, name), trust=a.trust)
            try:
                opt_sk, records = tstate.state_records(sd, weights, spec=spec, update=update, notes=notes,
                                                       param_order=_param_order(a.param_order, inp, sd, weights))
            except JaxguardError as exc:
                hint = ("; for the Trainer's own optimizer, --param-order trainer asserts its order"
                        if inp.kind == "hf-checkpoint" and a.param_order is None and "param_names" in str(exc) else "")
                raise type(exc)(f"{os.path.join(inp.path, name)}: {exc}{hint}") from None
            meta = {"framework": "torch", "tree": {"__dict__": [["optimizer", opt_sk]]},
                    "torch_version": tstate.torch_version(), "source": inp.kind, "source_file": name, **notes}
            extra = {"tau": spec.tau, "clip": spec.clip, "codec": spec.codec, "bound": spec.bound,
                     "partition": spec.partition}
            s = writer.to_file(os.path.join(stage, compressed_name(name)), records, meta, extra_header=extra,
                               progress=not a.json)
            for k in (*audit.TOTAL_KEYS, "encode_seconds"):
                totals[k] = totals.get(k, 0) + (s.get(k) or 0)
            written += s["container_bytes"]
            stored += notes.pop("stored_exactly", [])
            del records, sd
    src = sum(os.path.getsize(os.path.join(inp.path, n)) for n in plain)
    summary = {**audit.compression_summary(totals, written), "encode_seconds": totals["encode_seconds"]}
    summary.update(input=inp.description, input_kind=inp.kind, optimizer_files=[compressed_name(n) for n in plain],
                   source_bytes=src, container_ratio=written / max(src, 1), output=a.output, stored_exactly=stored)
    print_summary(summary, a.json)
    return 0


def _param_order(value, inp, opt_sd, weights):
    """``--param-order`` for a trainer directory: ``trainer`` (`trainer_param_order`),
    ``model`` (the model's ``named_parameters()`` order, from config.json, or the order of
    ``pytorch_model.bin``; ``model.safetensors`` keeps its tensors sorted by name, not in
    the model's order), a file of names, or None."""
    from jaxguard.cli.inputs import param_order
    if value is None:
        return None
    if value == "trainer":
        return trainer_param_order(inp.path, opt_sd)
    if value == "model":
        if os.path.isfile(os.path.join(inp.path, "config.json")):
            return [n for n, _ in _meta_model(inp.path).named_parameters()]
        if not any(n.startswith("pytorch_model") for n in inp.names):
            raise CheckpointError(f"--param-order model: {inp.path} holds its weights in safetensors, sorted by name, "
                                  "and no config.json naming the model: its parameter order is not recorded; pass "
                                  "--param-order FILE with the names in the optimizer's order")
        return "model"
    return param_order(value)


def _restore(a) -> int:
    import torch
    import torch_compat
    inp = a.input
    packed = _jg_files(inp)
    if not packed:
        raise CheckpointError(f"{inp.path} is {inp.description} with no compressed optimizer file (optimizer*.jg): "
                              "nothing to restore")
    with _staged(a.output) as stage:
        _copy_others(inp.path, stage, set(packed))
        written = []
        for name in packed:
            tree, header = torch_compat.restore_tree(os.path.join(inp.path, name))
            if not isinstance(tree, dict) or "optimizer" not in tree:
                raise CheckpointError(f"{os.path.join(inp.path, name)} holds no optimizer state")
            target = restored_name(inp.kind, name, header.get("meta") or {})
            torch.save(tree["optimizer"], os.path.join(stage, target))
            written.append(target)
    print(f"restored {inp.path} ({inp.description}) -> {a.output} ({', '.join(written)} decoded, the other files "
          "copied)")
    return 0


def _read(verb, a, file_verb, print_info) -> int:
    inp = a.input
    packed = _jg_files(inp)
    if verb == "verify":
        if not packed:
            print(f"FAILED {inp.path} ({inp.description}): no compressed optimizer file (optimizer*.jg) to verify; "
                  f"its {', '.join(_plain_files(inp)) or 'optimizer'} is stored uncompressed")
            return 1
        status = 0
        for name in packed:
            path = os.path.join(inp.path, name)
            status |= file_verb(argparse.Namespace(**{**vars(a), "container": path, "input": inp.inside(path)}))
        return status
    info = {"input": inp.description, "input_kind": inp.kind, "optimizer_files": inp.optimizer_files(),
            "compressed": packed, "files": list(inp.names)}
    for name in packed:
        path = os.path.join(inp.path, name)
        sub = argparse.Namespace(**{**vars(a), "container": path, "input": inp.inside(path), "json": True})
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            file_verb(sub)
        info[name] = json.loads(buf.getvalue().strip().splitlines()[-1])
    if a.json:
        print(json.dumps(info, sort_keys=True))
        return 0
    print_info({k: v for k, v in info.items() if k not in packed}, False)
    for name in packed:
        print(f"{name:>16}:")
        print_info(info[name], False)
    return 0


def trainer_param_order(directory: str, opt_sd) -> list:
    """``--param-order trainer``: the parameter names in the order the Hugging Face Trainer
    gave them to its optimizer (`Trainer.create_optimizer`: the weights it decays, then the
    rest, each in ``model.named_parameters()`` order), for a Trainer checkpoint whose
    ``optimizer.pt`` has no ``param_names``.

    The model is built on the meta device from the directory's ``config.json`` (its
    ``architectures`` class in transformers: no weights are read or allocated) and grouped by
    the installed Trainer's own ``get_decay_parameter_names``.  This is an assertion the user
    makes (the optimizer is the Trainer's default one); the groups' sizes and every moment's
    shape are checked against it.

    Args:
      directory: the checkpoint directory.
      opt_sd: its optimizer state_dict.

    Returns:
      The names, one per optimizer parameter, groups in order.

    Raises:
      CheckpointError: no config.json or architecture transformers has; group sizes that
        are not the Trainer's (one line naming ``--param-order FILE``).
    """
    import transformers
    model = _meta_model(directory)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [[n for n, _ in named if n in decay], [n for n, _ in named if n not in decay]]
    sizes = [len(g["params"]) for g in opt_sd["param_groups"]]
    if sizes != [len(g) for g in groups]:
        raise CheckpointError(f"--param-order trainer: the optimizer's param groups hold {sizes} parameters, but the "
                              f"Trainer groups {type(model).__name__}'s as {[len(g) for g in groups]} (decayed, not "
                              "decayed): not the Trainer's own optimizer; pass --param-order FILE with the names in "
                              "its order")
    return groups[0] + groups[1]


def _meta_model(directory: str):
    """The model of a Hugging Face checkpoint directory built on the meta device from its
    ``config.json`` (the ``architectures`` class in transformers; nothing allocated)."""
    try:
        import torch
        import transformers
    except ImportError:
        raise CheckpointError("--param-order trainer|model of a trainer directory needs transformers (pip install -e "
                              "\".[hf]\")") from None
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"--param-order: {directory} has no readable config.json ({_first(exc)}); pass "
                              "--param-order FILE with the names in the optimizer's order") from None
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise CheckpointError(f"--param-order: config.json names the architecture {arch!r}, which transformers "
                              f"{transformers.__version__} does not have; pass --param-order FILE")
    with torch.device("meta"):
        return cls(config)


def _first(exc) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
