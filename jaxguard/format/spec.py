"""The format's specification, numpy only: the block size, the codec registry, the tables.

One registry knows each codec (the numcodecs pattern): `CODECS` maps a codec id (the
string stored in a container entry's ``"codec"`` field) to a `CodecSpec` that says how
its codes and block parameters are laid out and which decode it uses.  The writer
(`jaxguard.format.container`), the numpy reader (`jaxguard.format.reader`), the JAX core
(`jaxguard.core`), the torch decoder (`torch_compat.codes_torch`) and the CLI ask this
registry; none of them keeps its own list of codec names.

Adding a codec: one `CodecSpec` entry here, its numpy decode in the reader, its JAX
encode/decode in the core, golden vectors (docs/architecture.md has the steps).

One algorithm, one name: the bitsandbytes dynamic-tree map is called ``dynamic8``
everywhere in the code (`dynamic_map` here, the stored tables ``dynamic8s``/``dynamic8u``,
`jaxguard.core.codes.dynamic8_encode_block`/``dynamic8_decode_block``, the readers'
``table_decode``).  The ids users type keep their names: the codec ids ``block8`` and
``block8-unguarded`` (decode ``"block8"``) and the training-time quant policy ``d8``
(`jaxguard.quant.codecs.D8Code`) all use that one map and those functions.

Certification is an option, not a codec: ``block8-unguarded`` (``certified=False``) is
the ``block8`` decode written without the guard, kept readable; an entry's ``config``
may also carry ``"certify": false`` for any codec (`entry_certified`).

Numerical contract
------------------
The tables below are stored bit for bit (float32 bit patterns), so every reader and
writer of any version uses the same values; a container that uses a table also carries
it in its payload and the reader decodes with the stored copy.
"""
from __future__ import annotations

__all__ = ["ReaderError", "BLOCK", "TABLE_SIZE", "FIXED_SECTIONS", "PACKED_SECTIONS", "ESCAPE_FORMS", "LAYOUTS",
           "UnknownCodecError", "CodecSpec", "CODECS", "register", "unregister", "DEFAULT_CODEC",
           "DEFAULT_TAU", "DEFAULT_CLIP", "DEFAULT_BOUND", "DEFAULT_PARTITION", "get", "codec_ids",
           "decode_ids", "entry_certified", "dynamic_map", "TABLES"]

import dataclasses

import numpy as np

from jaxguard.errors import ConfigError, ContainerError

BLOCK = 256
"""Coordinates per block: every codec's block parameters cover this many coordinates."""

TABLE_SIZE = 256
"""Entries of every stored table (one per 8-bit code)."""

FIXED_SECTIONS = ("m_codes", "v_codes", "m_params", "v_params", "escape_mask", "escape_pairs")
PACKED_SECTIONS = ("widths", "m_codes", "v_codes", "m_params", "v_params", "escape_pairs")
ANS_SECTIONS = ("widths", "mv_rans", "v_params", "escape_pairs")
ESCAPE_FORMS = ("escape_mask", "escape_index")
LOW_SECTIONS = ((), ("m_low",), ("v_low",), ("m_low", "v_low"))
"""The optional low-bit sections of an ``mv_rans`` entry (blocks wider than 8 bits)."""
ZSTD_SECTIONS = ("m_codes", "v_codes", "params", "escape_index", "escape_pairs")
ZSTD_WIDE = ((), ("widths", "m_high"), ("widths", "v_high"), ("widths", "m_high", "v_high"))
"""The optional sections of a ``log8-rel-zstd`` entry whose blocks are not all 8 bits wide."""
LAYOUTS = {
    "fixed": (FIXED_SECTIONS,),
    # jaxguard.format.packed: per-block widths, and exactly one of the two escape forms
    "packed": tuple(PACKED_SECTIONS + (e,) for e in ESCAPE_FORMS),
    # per tensor either the packed sections or one rANS buffer of the m and v codes whose
    # lanes carry the bf16 m-scales (``mv_rans`` replaces m_codes, v_codes and m_params);
    # ``m_low`` / ``v_low`` hold the bits below the top 8 of the fields of wider blocks
    "ans": tuple(PACKED_SECTIONS + (e,) for e in ESCAPE_FORMS)
    + tuple(ANS_SECTIONS + low + (e,) for low in LOW_SECTIONS for e in ESCAPE_FORMS),
    # jaxguard.format.entropy: the codes, parameters and widths as zstd streams
    "zstd": tuple(ZSTD_SECTIONS + wide for wide in ZSTD_WIDE),
}
"""The section-name sets a moments entry of each layout may have (docs/format.md)."""


class ReaderError(ContainerError):
    """The file is not a valid jaxguard container (message says what failed)."""


class UnknownCodecError(ConfigError, KeyError):
    """A codec id that is not registered (a `ConfigError`; also a `KeyError` for lookups)."""

    __str__ = Exception.__str__   # one line, not KeyError's quoted repr


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """How one codec's moments are stored.

    Attributes:
      id: the codec id stored in container entries and accepted by ``--codec``.
      summary: one line for help texts.
      m_code_dtype, v_code_dtype: numpy dtype (little-endian string) of one coordinate's
        m and v code after any unpacking.
      m_params, v_params: float32 block parameters per block in the fixed layout.
      layout: ``"fixed"`` (sections m_codes, v_codes, m_params, v_params, escape_mask,
        escape_pairs), ``"packed"`` (jaxguard.format.packed: per-block widths), ``"ans"``
        (per tensor the packed sections, or an ``mv_rans`` section instead of m_codes,
        v_codes and m_params: jaxguard.format.rans) or ``"zstd"`` (log8-rel's codes and
        parameters as zstd streams: jaxguard.format.entropy).
      decode: the id of the fixed decode this codec's codes go through (its own id
        unless it shares another codec's arithmetic).
      tables: names of the stored tables its decode needs.
      certified: False for ids that name a policy without the guard (kept readable).
      legacy: True for ids that are read but no longer offered for writing.
    """

    id: str
    summary: str
    m_code_dtype: str
    v_code_dtype: str
    m_params: int
    v_params: int
    layout: str = "fixed"
    decode: str = ""
    tables: tuple = ()
    certified: bool = True
    legacy: bool = False

    def __post_init__(self):
        if not self.decode:
            object.__setattr__(self, "decode", self.id)
        if self.layout not in LAYOUTS:
            raise ConfigError(f"codec {self.id!r}: layout={self.layout!r} is unknown; use one of {', '.join(LAYOUTS)}")
        unknown = [t for t in self.tables if t not in TABLES]
        if unknown:
            raise ConfigError(f"codec {self.id!r}: tables {unknown} are unknown; use names from {', '.join(TABLES)}")


CODECS: dict = {}


def register(spec: CodecSpec) -> CodecSpec:
    """Add `spec` to the registry.

    Args:
      spec: the codec's `CodecSpec`; its `decode` must be a registered id that decodes
        as itself (or its own id), so that every reader can resolve it.

    Returns:
      `spec`.

    Raises:
      ConfigError: the id is already registered, or `decode` names an unknown id.
    """
    if spec.id in CODECS:
        raise ConfigError(f"codec id {spec.id!r} is already registered; pick another id")
    if spec.decode != spec.id and (spec.decode not in CODECS or CODECS[spec.decode].decode != spec.decode):
        raise ConfigError(f"codec {spec.id!r}: decode={spec.decode!r} is not a registered base decode; "
                          f"use one of {', '.join(decode_ids())}")
    CODECS[spec.id] = spec
    return spec


def unregister(codec_id: str) -> None:
    """Remove `codec_id` from the registry (for codecs registered at run time, e.g. tests).

    Args:
      codec_id: a registered id.

    Raises:
      UnknownCodecError: `codec_id` is not registered.
    """
    get(codec_id)
    del CODECS[codec_id]


# The one default codec of every writer, verb and adapter (imported from here).
# log8-rel-zstd: log8-rel's certified codes (m relative to sqrt(v~)) through a lossless zstd
# stage (jaxguard/format/entropy.py); the same decoded values in fewer bytes.  Files of every
# earlier default still read.
DEFAULT_CODEC = "log8-rel-zstd"
# The other guard settings' defaults, defined here once (numpy-only, so the CLI and the
# reader know them without JAX); `jaxguard.GuardSpec` takes its defaults from these.
DEFAULT_TAU = 0.01        # |u1 - u2| <= tau * lr
DEFAULT_CLIP = 0.2        # for every gradient |g| <= clip
DEFAULT_BOUND = "shared"
DEFAULT_PARTITION = "mixed"


def get(codec_id: str) -> CodecSpec:
    """The spec of `codec_id`.

    Args:
      codec_id: a codec id as stored in a container entry or passed as ``codec=``.

    Returns:
      Its `CodecSpec`.

    Raises:
      UnknownCodecError: (a `ConfigError` and a `KeyError`) with a one-line message
        naming the registered ids.
    """
    try:
        return CODECS[codec_id]
    except (KeyError, TypeError):   # TypeError: an unhashable id read from a header
        raise UnknownCodecError(f"codec {str(codec_id)[:80]!r} is unknown; registered: {', '.join(CODECS)}") from None


def codec_ids(*, writable: bool = True) -> tuple:
    """Registered ids in registration order.

    Args:
      writable: leave out legacy ids (read, but no longer offered for writing).

    Returns:
      A tuple of ids (the CLI's ``--codec`` choices when `writable`).
    """
    return tuple(k for k, s in CODECS.items() if not (writable and s.legacy))


def decode_ids() -> tuple:
    """The base decodes: registered ids whose `decode` is their own id."""
    return tuple(k for k, s in CODECS.items() if s.decode == k)


def entry_certified(entry: dict) -> bool:
    """Whether a container's moments entry was written under the guard.

    False when its codec is registered with ``certified=False`` (``block8-unguarded``)
    or its ``config`` has ``"certify": false`` (`GuardConfig(certify=False)`).

    Args:
      entry: a moments entry of a container header.

    Returns:
      True if the entry's coordinates were certified (or stored exactly as escapes).

    Raises:
      UnknownCodecError: the entry's codec is not registered.
    """
    config = entry.get("config")
    opted_out = isinstance(config, dict) and config.get("certify") is False
    return get(entry.get("codec")).certified and not opted_out


# ---------------------------------------------------------------- tables
# The bitsandbytes dynamic-tree map (`bitsandbytes.functional.create_dynamic_map`,
# max_exponent_bits=7, 8 bits), signed (m) and unsigned (v), as float32 bit patterns.
# It depends on torch's float32 linspace (numpy's differs in 22 entries), hence stored.
_DYNAMIC8_SIGNED_BITS = (
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a,
    0xbf650000, 0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666,
    0xbf4bcccd, 0xbf483333, 0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334,
    0xbf32999a, 0xbf2f0000, 0xbf2b6666, 0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000,
    0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a, 0xbf0b0000, 0xbf076666, 0xbf03cccc,
    0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a, 0xbedc6666, 0xbed53333,
    0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000, 0xbea2cccc,
    0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000,
    0xbddb3334, 0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8,
    0xbda75c2a, 0xbda1999a, 0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd,
    0xbd7e147b, 0xbd728f5d, 0xbd670a3d, 0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3,
    0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148, 0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7,
    0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148, 0xbc1f3b64, 0xbc160418,
    0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4, 0xbbab020d,
    0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705,
    0xb923d70b, 0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94,
    0xb513a3b7, 0x00000000, 0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034,
    0x388aefb3, 0x38ba1f4b, 0x3923d70b, 0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1,
    0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d, 0x3af1a9fc, 0x3b1db22d, 0x3b428f5c,
    0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4, 0x3bcfdf3b, 0x3be24dd3,
    0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148, 0x3c68f5c3,
    0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f,
    0x3d670a3d, 0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b,
    0x3d9bd70a, 0x3da1999a, 0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667,
    0x3dc428f7, 0x3dc9eb85, 0x3ddb3334, 0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333,
    0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd, 0x3e6f3333, 0x3e7d9999, 0x3e860000,
    0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000, 0x3eb13333, 0x3eb86666,
    0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a, 0x3eeacccc,
    0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd,
    0x3f2b6666, 0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000,
    0x3f44999a, 0x3f483333, 0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333,
    0x3f5dcccd, 0x3f616666, 0x3f650000, 0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666,
    0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
)
_DYNAMIC8_UNSIGNED_BITS = (
    0x00000000, 0x34ae7baa, 0x35500998, 0x360e9b38, 0x3692ccf6, 0x36de4c51, 0x3714e5d5,
    0x3783126e, 0x37e171a0, 0x381fe868, 0x384f1800, 0x387e479a, 0x3896bb99, 0x38ae5364,
    0x38c5eb31, 0x3906594b, 0x394154ca, 0x397c5049, 0x399ba5e4, 0x39b923a2, 0x39d6a163,
    0x39f41f22, 0x3a08ce71, 0x3a178d50, 0x3a264c30, 0x3a350b10, 0x3a43c9ef, 0x3a5288d0,
    0x3a6147af, 0x3a70068e, 0x3a7ec56e, 0x3a958106, 0x3aba5e35, 0x3adf3b64, 0x3b020c4a,
    0x3b147ae1, 0x3b26e978, 0x3b395810, 0x3b4bc6a7, 0x3b5e3540, 0x3b70a3d7, 0x3b818937,
    0x3b8ac082, 0x3b93f7cf, 0x3b9d2f1a, 0x3ba66666, 0x3baf9db2, 0x3bb8d4fd, 0x3bc20c4a,
    0x3bcb4395, 0x3bd47ae1, 0x3bddb22e, 0x3be6e978, 0x3bf020c5, 0x3bf9580f, 0x3c0147ae,
    0x3c05e354, 0x3c0a7ef9, 0x3c0f1aa0, 0x3c13b645, 0x3c1851eb, 0x3c1ced92, 0x3c218937,
    0x3c2f5c2a, 0x3c466667, 0x3c5d70a3, 0x3c747ae2, 0x3c85c28f, 0x3c9147af, 0x3c9ccccd,
    0x3ca851eb, 0x3cb3d70b, 0x3cbf5c29, 0x3ccae147, 0x3cd66667, 0x3ce1eb87, 0x3ced70a3,
    0x3cf8f5c3, 0x3d023d70, 0x3d080000, 0x3d0dc28f, 0x3d13851f, 0x3d1947af, 0x3d1f0a3d,
    0x3d24cccd, 0x3d2a8f5c, 0x3d3051eb, 0x3d36147b, 0x3d3bd70a, 0x3d41999a, 0x3d475c28,
    0x3d4d1eb8, 0x3d52e147, 0x3d58a3d7, 0x3d5e6667, 0x3d6428f7, 0x3d69eb87, 0x3d6fae15,
    0x3d7570a3, 0x3d7b3333, 0x3d807ae2, 0x3d835c2a, 0x3d863d71, 0x3d891eb8, 0x3d8c0000,
    0x3d8ee148, 0x3d91c290, 0x3d94a3d7, 0x3d97851f, 0x3d9a6667, 0x3d9d47af, 0x3da028f6,
    0x3da30a3e, 0x3da5eb85, 0x3da8cccd, 0x3dabae15, 0x3dae8f5c, 0x3db170a4, 0x3db451eb,
    0x3db73333, 0x3dba147b, 0x3dbcf5c3, 0x3dbfd70b, 0x3dc2b852, 0x3dc5999a, 0x3dc87ae2,
    0x3dcb5c29, 0x3dd40000, 0x3de26666, 0x3df0cccd, 0x3dff3333, 0x3e06cccc, 0x3e0e0000,
    0x3e153334, 0x3e1c6666, 0x3e23999a, 0x3e2acccc, 0x3e320000, 0x3e393334, 0x3e406666,
    0x3e47999a, 0x3e4ecccc, 0x3e560000, 0x3e5d3334, 0x3e646666, 0x3e6b999a, 0x3e72cccc,
    0x3e7a0000, 0x3e809999, 0x3e843333, 0x3e87cccd, 0x3e8b6666, 0x3e8f0000, 0x3e92999a,
    0x3e963333, 0x3e99cccc, 0x3e9d6666, 0x3ea10000, 0x3ea4999a, 0x3ea83333, 0x3eabcccc,
    0x3eaf6666, 0x3eb30000, 0x3eb6999a, 0x3eba3333, 0x3ebdcccc, 0x3ec16666, 0x3ec50000,
    0x3ec8999a, 0x3ecc3333, 0x3ecfcccc, 0x3ed36666, 0x3ed70000, 0x3eda999a, 0x3ede3333,
    0x3ee1cccc, 0x3ee56666, 0x3ee90000, 0x3eec999a, 0x3ef03333, 0x3ef3cccc, 0x3ef76666,
    0x3efb0000, 0x3efe9999, 0x3f01199a, 0x3f02e666, 0x3f04b333, 0x3f068000, 0x3f084ccc,
    0x3f0a199a, 0x3f0be666, 0x3f0db334, 0x3f0f8000, 0x3f114ccd, 0x3f13199a, 0x3f14e666,
    0x3f16b334, 0x3f188000, 0x3f1a4ccd, 0x3f1c199a, 0x3f1de666, 0x3f1fb334, 0x3f218000,
    0x3f234ccd, 0x3f25199a, 0x3f26e666, 0x3f28b334, 0x3f2a8000, 0x3f2c4ccd, 0x3f2e199a,
    0x3f2fe666, 0x3f31b334, 0x3f338000, 0x3f354ccd, 0x3f37199a, 0x3f38e666, 0x3f3ab334,
    0x3f3c8000, 0x3f3e4ccd, 0x3f40199a, 0x3f41e666, 0x3f43b334, 0x3f458000, 0x3f474ccc,
    0x3f49199a, 0x3f4ae666, 0x3f4cb334, 0x3f4e8000, 0x3f504ccc, 0x3f52199a, 0x3f53e666,
    0x3f55b334, 0x3f578000, 0x3f594ccc, 0x3f5b199a, 0x3f5ce666, 0x3f5eb334, 0x3f608000,
    0x3f624ccc, 0x3f64199a, 0x3f65e666, 0x3f67b334, 0x3f698000, 0x3f6b4ccc, 0x3f6d199a,
    0x3f6ee666, 0x3f70b334, 0x3f728000, 0x3f744ccc, 0x3f76199a, 0x3f77e666, 0x3f79b334,
    0x3f7b8000, 0x3f7d4ccc, 0x3f7f199a, 0x3f800000,
)


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256-entry bitsandbytes dynamic map, ``dynamic8`` (the one implementation).

    Bit-equal to ``bitsandbytes.functional.create_dynamic_map(signed=signed)``
    (tests/core/test_codec.py checks it when bitsandbytes is installed).

    Args:
      signed: the signed map (for m, table ``dynamic8s``) or the unsigned one (for v,
        ``dynamic8u``).

    Returns:
      A new float32 array of `TABLE_SIZE` sorted entries.
    """
    bits = _DYNAMIC8_SIGNED_BITS if signed else _DYNAMIC8_UNSIGNED_BITS
    return np.asarray(bits, np.uint32).view(np.float32).copy()


TABLES = {"dynamic8s": lambda: dynamic_map(True), "dynamic8u": lambda: dynamic_map(False)}
"""Stored tables by name (a container that uses one carries it in its payload)."""


# ---------------------------------------------------------------- the registered codecs
register(CodecSpec("log8", "linear8 m, AL8 v (the paper's codec)", "i1", "u1", 1, 2))
register(CodecSpec("log8-rel", "m relative to sqrt(v~), AL8 v (the default)", "i1", "u1", 1, 4))
register(CodecSpec("bf16", "bfloat16 m and v", "<u2", "<u2", 0, 0))
register(CodecSpec("block8", "bitsandbytes dynamic map, absmax per block", "u1", "u1", 1, 1,
                   tables=("dynamic8s", "dynamic8u")))
register(CodecSpec("block8-unguarded", "block8 without the guard (negative control)", "u1", "u1", 1, 1,
                   decode="block8", tables=("dynamic8s", "dynamic8u"), certified=False))
register(CodecSpec("logrel-aw", "log8-rel decode, 4..12-bit widths per block, compact parameters", "i1", "u1",
                   1, 4, layout="packed", decode="log8-rel"))
register(CodecSpec("logrel-ans", "logrel-aw with rANS-coded m and v code streams (per tensor, when smaller)",
                   "i1", "u1", 1, 4, layout="ans", decode="log8-rel"))
register(CodecSpec("log8-rel-zstd", "log8-rel's codes through a zstd entropy stage (the default)", "i1", "u1", 1, 4,
                   layout="zstd", decode="log8-rel"))
