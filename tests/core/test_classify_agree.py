"""The host classifier (`certify.classify`, numpy bit tests) and the device one
(`certify.device_classify`, inside a jitted program) give the same booleans: the logrel-ans
rate pass classifies its candidate moves on the host and the final certificate on the device."""
import jax
import numpy as np

from jaxguard.core import certify

SPECIAL = np.array([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 1.1754944e-38, 3e-38, 1e-30, 2.0**-80, 2.0**-79,
                    1e-3, 1.0, -1.0, 2.0**60, 3.4028235e38, -3.4028235e38, np.inf, -np.inf, np.nan], np.float32)


def test_host_and_device_classifiers_agree_on_adversarial_values():
    rng = np.random.default_rng(0)
    n = 1 << 14
    draw = lambda: np.where(rng.random(n) < 0.5, rng.choice(SPECIAL, n),          # noqa: E731
                            (rng.standard_normal(n) * 10.0 ** rng.uniform(-40, 38, n)).astype(np.float32))
    m, v, p = draw(), np.abs(draw()), draw()
    near = lambda x: np.where(rng.random(n) < 0.5, x, np.nextafter(x, np.float32(np.inf)))   # noqa: E731
    mt, vt = near(m).astype(np.float32), near(v).astype(np.float32)
    mt[::7], vt[::5] = draw()[::7], np.abs(draw())[::5]
    host = certify.classify(m, v, p, mt, vt)
    dev = [np.asarray(x) for x in jax.jit(certify.device_classify)(m, v, p, mt, vt)]
    for h, d, name in zip(host, dev, ("exact", "ok")):
        assert np.array_equal(np.asarray(h), d), (name, int((np.asarray(h) != d).sum()))
    assert host[0].any() and host[1].any() and not host[1].all()
