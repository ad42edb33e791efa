"""`jaxguard compress` and `restore` turn off numpy's huge-page advice for the process
(first touches of its large arrays otherwise compact memory on the spot, on a machine whose
page cache is full); the other verbs, and any library caller, keep numpy's default."""
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
np = pytest.importorskip("numpy")

from helpers import adam_checkpoint, run_probe  # noqa: E402

if not hasattr(getattr(np, "_core", None) or np.core, "multiarray") or not hasattr(
        (getattr(np, "_core", None) or np.core).multiarray, "_get_madvise_hugepage"):
    pytest.skip("this numpy has no huge-page switch", allow_module_level=True)

PROBE = """
import json, sys
import numpy as np
from jaxguard.cli.main import main
core = getattr(np, "_core", None) or np.core
before = core.multiarray._get_madvise_hugepage()
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "before": before, "after": core.multiarray._get_madvise_hugepage()}))
"""


def _run(*argv):
    env = dict(os.environ)
    env.pop("NUMPY_MADVISE_HUGEPAGE", None)
    return run_probe(PROBE, *argv, env=env)


def test_compress_and_restore_turn_numpy_huge_pages_off(tmp_path):
    src = tmp_path / "src.pt"
    model = adam_checkpoint(src, (32, 4), steps=1, batch=8)
    on_linux = sys.platform.startswith("linux")
    for argv in (("compress", src, "-o", tmp_path / "c.jg"), ("restore", tmp_path / "c.jg", "-o", tmp_path / "r.pt")):
        rep = _run(*argv)
        assert rep["rc"] == 0 and rep["after"] is False, (argv[0], rep)
        assert rep["before"] is on_linux    # numpy's default, changed by the verb
    control = _run("inspect", tmp_path / "c.jg")   # another verb: numpy's default kept
    assert control["rc"] == 0 and control["after"] is control["before"] is on_linux
    back = torch.load(tmp_path / "r.pt", weights_only=True)
    assert torch.equal(back["model"]["0.weight"], model.state_dict()["0.weight"])
