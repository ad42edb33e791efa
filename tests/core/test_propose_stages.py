"""log8-rel's proposal runs as three programs (`codecs.CoreCodec.propose_stages`: v's codes
with the block masks, then m's codes and both decodes, then the bit classification) where
it ran as one (`guard.propose_blocks`); only XLA's fusion differs.  The three give the
one's bits for every output, on adversarial moments (magnitudes over float32's whole range,
NaN, infinities, signed zeros, subnormals, negative v, partial blocks)."""
import functools

import jax
import numpy as np
import pytest

from jaxguard.core import certify, codecs, guard
from jaxguard.core.codes import BLOCK
from test_dense_reject import adversarial


@functools.partial(jax.jit, static_argnames=("codec",))
def one_program(mb, vb, pb, in_tensor, codec):
    """The masks, the proposal and the classification in one program (as the guard ran them)."""
    valid, vpos = certify.device_masks(mb, vb, pb, in_tensor)
    out = codecs.propose(mb, vb, valid, vpos, codec=codec)
    return (*out, *certify.device_classify(mb, vb, pb, out[4], out[5]))


def _blocks(seed):
    m, v, p = adversarial(seed, n=40 * BLOCK - 77)
    rng = np.random.default_rng(seed)
    f32 = np.finfo(np.float32)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, f32.max, -f32.max, f32.tiny, f32.tiny / 2**20,
                        -f32.tiny / 2**3, 1e-30, 2.0**-80, 2.0**-81, 1.0], np.float32)
    for x in (m, v, p):   # a few special values sprinkled over every array
        at = rng.integers(0, x.size, 60)
        x[at] = rng.choice(special, at.size)
    n = m.size
    nb = -(-n // BLOCK) + 2
    out = []
    for x in (m, v, p):
        b = np.zeros(nb * BLOCK, np.float32)
        b[:n] = x
        b[n:n + BLOCK] = rng.choice(special, BLOCK)         # a block of special values only
        out.append(b.reshape(nb, BLOCK))                      # and an all-zero last block
    in_tensor = np.zeros(nb * BLOCK, bool)
    in_tensor[:n + BLOCK] = True
    return (*out, in_tensor.reshape(nb, BLOCK))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_staged_proposal_gives_the_one_programs_bits(seed):
    assert codecs.get("log8-rel").propose_stages is not None
    blocks = _blocks(seed)
    one = one_program(*blocks, codec="log8-rel")
    staged = guard.propose_blocks(*blocks, "log8-rel")
    assert len(one) == len(staged) == 8
    for k, (a, b) in enumerate(zip(one, staged)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, k
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"output {k}")
    exact, ok = np.asarray(staged[6]), np.asarray(staged[7])
    assert exact.any() and ok.any() and not ok.all()          # both sides of the classifier are exercised


def test_codecs_without_stages_keep_the_one_program():
    blocks = _blocks(5)
    for codec in ("log8", "bf16", "block8"):
        assert codecs.get(codec).propose_stages is None
        for a, b in zip(one_program(*blocks, codec=codec), guard.propose_blocks(*blocks, codec)):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
