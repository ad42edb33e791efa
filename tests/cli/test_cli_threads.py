"""`jaxguard compress` with more than one encode thread starts jax's CPU backend with an
intra-op pool of one thread (each encode thread runs its programs on its own core) and
gives every thread back the CPUs the process had; with one encode thread XLA keeps its
pool over every core.  The container is the same either way."""
import os

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

from helpers import adam_checkpoint, container_canon, run_probe  # noqa: E402

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc/self/task")
    or len(os.sched_getaffinity(0)) < 2, reason="Linux with two or more CPUs")

# runs the CLI in a fresh process (the backend starts once a process), then reports its
# threads' names and CPUs
PROBE = """
import json, os, sys
cpus = sorted(os.sched_getaffinity(0))
from jaxguard.cli.main import main
rc = main(["compress", sys.argv[1], "-o", sys.argv[2], "--json"])
names, masks = [], []
for t in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{t}/stat") as fh:
        st = fh.read()
    names.append(st[st.index("(") + 1:st.rindex(")")])
    masks.append(sorted(os.sched_getaffinity(int(t))))
print(json.dumps({"rc": rc, "cpus": cpus, "names": names, "masks": masks}))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("threads") / "src.pt"
    adam_checkpoint(path, (64, 64, 8), steps=3, batch=16)
    return path


def _compress(src, out, threads):
    report = run_probe(PROBE, src, out, env=dict(os.environ, JAXGUARD_ENCODE_THREADS=str(threads)))
    assert report["rc"] == 0
    return report


def test_several_encode_threads_get_a_one_thread_xla_pool_and_keep_their_cpus(checkpoint, tmp_path):
    one = _compress(checkpoint, tmp_path / "one.jg", 1)
    two = _compress(checkpoint, tmp_path / "two.jg", 2)
    pool = lambda r: sum("Eigen" in n for n in r["names"])  # noqa: E731 - XLA names its pool's threads so
    if pool(one) == 0:
        pytest.skip("this jaxlib names its intra-op pool's threads otherwise")
    assert pool(one) == len(one["cpus"])   # the control: XLA's own pool, a thread a CPU
    assert pool(two) == 1
    assert all(m == two["cpus"] for m in two["masks"]), two["masks"]
    assert container_canon((tmp_path / "one.jg").read_bytes()) == container_canon((tmp_path / "two.jg").read_bytes())
