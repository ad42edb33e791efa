"""The CLI on inputs as users have them (issue 56, items 3 and 4).

* Checkpoints as found: numpy scalars, numpy and Python RNG states, ``argparse.Namespace``
  load without running code and come back with their types; anything else is one line
  naming ``--trust`` (no ANSI codes, nothing cut), and nothing the file names runs.
* One CLI for every input: ``compress``, ``restore``, ``verify`` and ``inspect`` on each kind
  of `jaxguard.cli.inputs` say which kind they saw, do their work where it applies and
  otherwise say in one line what the input is; no message names a format the input is not.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
from helpers import adam_run  # noqa: E402

import jaxguard as jg  # noqa: E402
from jaxguard.cli.inputs import DESCRIPTIONS, recognise  # noqa: E402
from jaxguard.cli.main import main  # noqa: E402


def _adam_run():
    return adam_run((12, 16, 3), steps=3, batch=8)


def found_checkpoint(path):
    """A checkpoint as training scripts write them: numpy scalars, RNG states, the run's args."""
    model, opt = _adam_run()
    np.random.seed(3)
    random.seed(3)
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": np.int64(7),
            "best_val_loss": np.float64(0.3125), "lr_now": np.float32(1e-3),
            "rng": {"numpy": np.random.get_state(), "python": random.getstate(), "torch": torch.get_rng_state()},
            "args": argparse.Namespace(lr=1e-3, layers=[12, 16, 3], name="run", seed=np.int64(3))}
    torch.save(ckpt, path)
    return ckpt


def test_a_checkpoint_as_found_compresses_restores_and_audits(tmp_path, capsys):
    src = found_checkpoint(tmp_path / "found.pt")
    assert main(["compress", str(tmp_path / "found.pt"), "-o", str(tmp_path / "found.jg"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["input_kind"] == "torch-file" and s["coordinates"] == 12 * 16 + 16 + 16 * 3 + 3
    assert main(["restore", str(tmp_path / "found.jg"), "-o", str(tmp_path / "back.pt")]) == 0
    assert "(a jaxguard container file)" in capsys.readouterr().out
    back = torch.load(tmp_path / "back.pt", weights_only=False)
    assert type(back["epoch"]) is np.int64 and back["epoch"] == 7
    assert type(back["best_val_loss"]) is np.float64 and back["best_val_loss"] == 0.3125
    assert type(back["lr_now"]) is np.float32 and back["lr_now"] == src["lr_now"]
    kind, key, pos, has_gauss, cached = back["rng"]["numpy"]
    assert (kind, pos, has_gauss, cached) == (src["rng"]["numpy"][0],) + tuple(src["rng"]["numpy"][2:])
    assert key.dtype == np.uint32 and np.array_equal(key, src["rng"]["numpy"][1])
    assert back["rng"]["python"] == src["rng"]["python"]          # a tuple again, bit for bit
    assert torch.equal(back["rng"]["torch"], src["rng"]["torch"])
    assert isinstance(back["args"], argparse.Namespace) and vars(back["args"]) == vars(src["args"])
    assert type(back["args"].seed) is np.int64
    np.random.set_state(back["rng"]["numpy"])                     # the restored state drives numpy as saved
    a = np.random.rand(3)
    np.random.set_state(src["rng"]["numpy"])
    assert np.array_equal(a, np.random.rand(3))
    assert main(["audit", str(tmp_path / "found.pt"), str(tmp_path / "found.jg"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["violations"] == 0
    assert main(["verify", str(tmp_path / "found.jg")]) == 0


class RunsCode:
    """What a malicious pickle names: a callable that runs when unpickled."""

    def __init__(self, canary):
        self.canary = canary

    def __reduce__(self):
        return os.system, (f"touch {self.canary}",)


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "jaxguard", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


def test_anything_else_is_one_clean_line_naming_trust_and_nothing_runs(tmp_path):
    model, opt = _adam_run()
    canary = tmp_path / "ran"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "hook": RunsCode(canary)},
               tmp_path / "evil.pt")
    done = _cli("compress", tmp_path / "evil.pt", "-o", tmp_path / "evil.jg")
    assert done.returncode == 2 and done.stdout == "", done
    err = done.stderr
    assert err.count("\n") == 1 and err.startswith("jaxguard: error: "), err     # one line
    assert "\x1b" not in err and "--trust" in err and "system" in err, err       # no ANSI; names what and how
    assert err.rstrip().endswith("(a plain torch.load, which runs whatever the file names)"), err   # not cut
    assert not canary.exists() and not (tmp_path / "evil.jg").exists()


def test_trust_loads_with_a_plain_torch_load(tmp_path, capsys):
    import collections
    model, opt = _adam_run()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "seen": collections.defaultdict(list, {"a": [2]})}, tmp_path / "c.pt")
    assert main(["compress", str(tmp_path / "c.pt"), "-o", str(tmp_path / "c.jg")]) == 2
    err = capsys.readouterr().err
    assert "refused without running it: it names builtins.list, collections.defaultdict, which" in err and "--trust" in err, err
    assert main(["compress", str(tmp_path / "c.pt"), "-o", str(tmp_path / "c.jg"), "--trust"]) == 0
    assert main(["restore", str(tmp_path / "c.jg"), "-o", str(tmp_path / "c2.pt")]) == 0
    assert torch.load(tmp_path / "c2.pt", weights_only=True)["seen"] == {"a": [2]}     # stored as the dict it is


# ---------------------------------------------------------------- every kind through every verb
@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """One input of each kind jaxguard reads without a trainer (those: test_trainer_dirs.py)."""
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    import torch.distributed.checkpoint as dcp
    import jaxguard.checkpoint as jgc
    import torch_compat
    from torch_compat.dcp import GuardedSavePlanner
    d = tmp_path_factory.mktemp("kinds")
    model, opt = _adam_run()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, d / "ckpt.pt")
    torch.save(opt.state_dict(), d / "optimizer_alone.pt")
    torch_compat.save(d / "opt.jg", opt)
    (d / "notes.txt").write_text("not a checkpoint\n")
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d / "dcp_plain"), no_dist=True)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d / "dcp_guarded"), planner=GuardedSavePlanner(),
             no_dist=True)
    params = {"w": jnp.linspace(-1.0, 1.0, 700)}
    tx = optax.adam(1e-3)
    st = tx.init(params)
    _, st = tx.update({"w": jnp.full(700, 0.01)}, st, params)
    jg.save(str(d / "sharded"), st, params, lr=1e-3, sharded=True)
    with ocp.CheckpointManager(str(d / "orbax")) as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=jgc.GuardedSave(st, params=params, lr=1e-3)))
        mngr.save(2, args=ocp.args.Composite(opt_state=jgc.GuardedSave(st, params=params, lr=1e-3, sharded=True),
                                             params=ocp.args.StandardSave(params)))
        mngr.wait_until_finished()
    (d / "empty").mkdir()
    return d


KINDS = {   # input -> kind recognised
    "ckpt.pt": "torch-file", "opt.jg": "container", "notes.txt": "other-file",
    "dcp_plain": "dcp", "dcp_guarded": "dcp", "sharded": "sharded", "orbax/1": "orbax-step", "orbax/2": "orbax-step",
    "orbax/1/opt_state": "orbax-item", "orbax/2/opt_state": "orbax-item",
}
# what each verb does: 0/1 its exit status, or the words of its one-line refusal (exit 2)
DONE = {
    ("compress", "torch-file"): 0, ("compress", "dcp"): 0, ("compress", "dcp_guarded"): "compressed already",
    ("verify", "dcp_plain"): 1,      # a plain DCP save: no jaxguard manifest to verify against
    ("compress", "container"): "compressed already", ("compress", "other-file"): "neither a jaxguard container",
    ("compress", "sharded"): "compressed already", ("compress", "orbax-step"): "compressed already",
    ("compress", "orbax-item"): "compressed already",
    ("restore", "container"): 0, ("restore", "dcp"): 0,
    ("restore", "torch-file"): "not a jaxguard container", ("restore", "other-file"): "nothing to restore",
    ("restore", "sharded"): "jaxguard.load", ("restore", "orbax-step"): "jaxguard.load",
    ("restore", "orbax-item"): "jaxguard.load",
    ("inspect", "torch-file"): "not a jaxguard container", ("inspect", "other-file"): "nothing to inspect",
    ("verify", "torch-file"): 1, ("verify", "other-file"): 1,
}
# words a message about one kind must never contain (the other formats' tell-tale names)
FOREIGN = {"dcp": ("manifest.json", "orbax"), "sharded": (".metadata", "DCP", "torch.distributed"),
           "orbax-item": (".metadata", "DCP", "torch.distributed"), "orbax-step": (".metadata", "DCP",
                                                                                    "torch.distributed"),
           "container": (".metadata", "DCP"), "torch-file": (".metadata", "DCP", "manifest.json"),
           "other-file": (".metadata", "manifest.json", "save did not finish")}   # (compress lists what it reads)


def test_recognise_every_kind(inputs):
    for name, kind in KINDS.items():
        assert recognise(inputs / name).kind == kind, name
    assert recognise(inputs / "optimizer_alone.pt").kind == "torch-file"
    assert recognise(inputs / "orbax/2").items == ("opt_state",)         # params is orbax's own item
    with pytest.raises(jg.CheckpointError, match=r"CheckpointManager directory \(steps 1, 2\): pass one step"):
        recognise(inputs / "orbax")
    with pytest.raises(jg.CheckpointError, match="does not recognise: none of a DCP .metadata"):
        recognise(inputs / "empty")


@pytest.mark.parametrize("verb", ["compress", "restore", "inspect", "verify"])
def test_every_kind_through_every_verb(verb, inputs, tmp_path, capsys):
    for name, kind in KINDS.items():
        args = [verb, str(inputs / name)]
        if verb in ("compress", "restore"):
            args += ["-o", str(tmp_path / f"{name.replace('/', '_')}.out")]
        want = DONE.get((verb, name), DONE.get((verb, kind), 0))
        rc = main(args)
        out, err = capsys.readouterr()
        said = out + err
        if isinstance(want, str):
            assert rc == 2 and want in err and err.count("\n") == 1, (name, verb, rc, out, err)
            assert err.startswith(f"jaxguard: error: {inputs / name} is {DESCRIPTIONS[kind]}"), (name, err)
        else:
            assert rc == want, (name, verb, rc, out, err)
            assert DESCRIPTIONS[kind] in said, (name, verb, said)        # says which kind it saw
        assert not any(w in said for w in FOREIGN.get(kind, ())), (name, verb, said)


def test_inspect_json_of_an_orbax_step_has_one_object_per_item(inputs, capsys):
    assert main(["inspect", str(inputs / "orbax/2"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["input_kind"] == "orbax-step" and list(info["items"]) == ["opt_state"]
    assert info["items"]["opt_state"]["coordinates"] == 700


def test_an_optimizer_state_dict_alone_says_so(inputs, capsys):
    assert main(["compress", str(inputs / "optimizer_alone.pt"), "-o", str(inputs / "x.jg")]) == 2
    err = capsys.readouterr().err
    assert "holds an optimizer state_dict alone" in err and "no 'model' key" not in err, err


def test_a_damaged_orbax_item_fails_verify_naming_its_file(inputs, tmp_path, capsys):
    step = tmp_path / "step"
    shutil.copytree(inputs / "orbax/1", step)
    f = step / "opt_state" / "opt_state.jaxguard"
    data = bytearray(f.read_bytes())
    data[200] ^= 1
    f.write_bytes(bytes(data))
    assert main(["verify", str(step)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAILED {f} (a jaxguard container file in {step} (an orbax checkpoint step directory))")
