"""Writes tests/golden/containers/*.jaxguard ONCE, with the main of 2026-12-01 (commit
88d1475, before the layout change of issue 12): one container per codec from the same
inputs as codes_v1.npz, plus a torch checkpoint compressed by the CLI.  Every later
version of jaxguard must read these files and decode them to the same bits (the reader's
decoded SHA-256 and the decoded arrays stored beside them in expected.npz).

    python tests/golden/make_container_golden.py
"""
import json
import os

import numpy as np

import jaxguard.format.container as C
import jaxguard.core.guard as G
import jaxguard.format.reader as R

HERE = os.path.join(os.path.dirname(__file__), "containers")
CODECS = ("log8", "log8-rel", "bf16", "block8", "block8-unguarded", "logrel-aw")


def inputs():
    rng = np.random.default_rng(20261201)
    n = 256 * 5 + 77
    v = rng.lognormal(-14, 2, n).astype(np.float32)
    m = (rng.normal(0, 1, n) * np.sqrt(v) * 0.3).astype(np.float32)
    v[256:512] = 0.0
    m[256:512] = 0.0
    v[512:520] = [1e-40, 3e38, 2e-38, 1e-45, 0.0, 1.0, np.nan, -1.0]
    m[512:520] = [-1e-40, 3e38, -3e38, 0.0, -0.0, 1e-30, 0.5, np.inf]
    p = rng.normal(0, 0.05, n).astype(np.float32)
    return m, v, p


def golden_entries(codec, m, v, p):
    """The entries of a codec's golden container: layer/w certified, its parameter, the step."""
    cfg = G.GuardConfig(lr=1e-3, step=100, codec=codec)
    enc = G.encode(m, v, p, cfg)
    return [C.Moments("layer/w", enc, {"config": cfg.to_json()}),
            C.Raw("layer/w.param", p, None),
            C.Raw("step", np.asarray(100, np.int64), None)]


def main():
    os.makedirs(HERE, exist_ok=True)
    m, v, p = inputs()
    expected = {}
    for codec in CODECS:
        entries = golden_entries(codec, m, v, p)
        data = C.build(entries, {"source": "golden", "codec": codec})
        path = os.path.join(HERE, f"{codec}.jaxguard")
        C.atomic_write(path, data)
        info = R.verify_file(path)
        header, payload = R.parse(open(path, "rb").read())
        tables = R.read_tables(header, payload)
        entry = [e for e in header["entries"] if e["name"] == "layer/w"][0]
        mt, vt = R.read_moments(entry, payload, tables)
        expected[f"{codec}/m_bits"] = np.asarray(mt, np.float32).view(np.uint32)
        expected[f"{codec}/v_bits"] = np.asarray(vt, np.float32).view(np.uint32)
        expected[f"{codec}/decoded_sha256"] = np.array(info["decoded_sha256"])
    np.savez_compressed(os.path.join(HERE, "expected.npz"), **expected)
    print(json.dumps({k: str(v) for k, v in expected.items() if k.endswith("sha256")}, indent=1))


if __name__ == "__main__":
    main()


def torch_container():
    """A torch Adam state saved by torch_compat.save (the torch adapter's header)."""
    import torch
    import torch_compat
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 7))
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3)
    x, y = torch.randn(64, 40), torch.randn(64, 7)
    for _ in range(20):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    path = os.path.join(HERE, "torch-adam.jaxguard")
    torch_compat.save(path, opt, tau=0.01)
    print("torch-adam", R.verify_file(path)["decoded_sha256"])


if __name__ == "__main__" and os.environ.get("GOLDEN_TORCH"):
    torch_container()
