"""`jaxguard compress` and `restore` turn off numpy's huge-page advice for the process
(first touches of its large arrays otherwise compact memory on the spot, on a machine whose
page cache is full); the other verbs, and any library caller, keep numpy's default."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
np = pytest.importorskip("numpy")
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
    res = subprocess.run([sys.executable, "-c", PROBE, *map(str, argv)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_compress_and_restore_turn_numpy_huge_pages_off(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 32)).square().sum().backward()
    opt.step()
    src = tmp_path / "src.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    on_linux = sys.platform.startswith("linux")
    for argv in (("compress", src, "-o", tmp_path / "c.jg"), ("restore", tmp_path / "c.jg", "-o", tmp_path / "r.pt")):
        rep = _run(*argv)
        assert rep["rc"] == 0 and rep["after"] is False, (argv[0], rep)
        assert rep["before"] is on_linux    # numpy's default, changed by the verb
    control = _run("inspect", tmp_path / "c.jg")   # another verb: numpy's default kept
    assert control["rc"] == 0 and control["after"] is control["before"] is on_linux
    back = torch.load(tmp_path / "r.pt", weights_only=True)
    assert torch.equal(back["model"]["weight"], model.state_dict()["weight"])
