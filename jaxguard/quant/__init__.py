"""Training-time quantized optimizer state (arXiv 2608.22322, "AL quantization").

* :mod:`~jaxguard.quant.codecs`: AL8/AL16 for non-negative states, uf8/d8 for signed ones;
  encodings are NamedTuples of arrays built on :mod:`jaxguard.core.codes` (one AL implementation,
  shared with the checkpoint guard).
* :func:`quantized`: an optax wrapper keeping any optimizer's state encoded between steps,
  with a per-state precision policy and topology-aware protection; :func:`state_bytes`.
* :func:`came`, :func:`apollo`: the two optimizers optax lacks, written optax style.
"""
from jaxguard.quant.codecs import (ALCode, D8Code, UF8Code, al_decode, al_encode,
                                   al_error_bound, d8_decode, d8_encode, decode, dequantize,
                                   encode, is_encoded, quantize, uf8_decode, uf8_encode)
from jaxguard.quant.wrapper import (DEFAULT_PROTECT_PATTERNS, NONNEGATIVE_FIELDS, PRESETS,
                                    SIGNED_FIELDS, QuantizedState, plan, quantized, state_bytes)
from jaxguard.quant.came import CameState, came, scale_by_came
from jaxguard.quant.apollo import ApolloState, apollo

__all__ = [
    "ALCode", "UF8Code", "D8Code", "al_encode", "al_decode", "al_error_bound",
    "uf8_encode", "uf8_decode", "d8_encode", "d8_decode", "quantize", "dequantize", "encode", "decode",
    "is_encoded",
    "quantized", "QuantizedState", "plan", "state_bytes", "PRESETS", "NONNEGATIVE_FIELDS",
    "SIGNED_FIELDS", "DEFAULT_PROTECT_PATTERNS", "came", "scale_by_came", "CameState",
    "apollo", "ApolloState",
]
