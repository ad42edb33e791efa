"""The integrity hashes of a container: which hash a file is sealed with, the hash objects
that make and check its trailer, ``payload_sha256`` and ``decoded_sha256``, and the one
line a mismatch is reported in (numpy and hashlib only; `blake3` when a file uses it).

The prefix's flags carry the id of the file's integrity hash in their low byte, so that the
trailer is verified before any header field is read; the header repeats it as ``hash``
(absent: SHA-256, every file written before BLAKE3).  The same function makes the trailer,
``payload_sha256`` and ``decoded_sha256`` (the keys keep their names: tools read them).
docs/security.md says what each hash protects against.
"""
from __future__ import annotations

__all__ = ["HASHES", "NEW_FILE_HASH", "HASH_FLAG_BITS", "hasher", "hash_label", "hash_flags", "header_hash",
           "prefix_hash", "check_header_hash", "decoded_mismatch"]

import hashlib

from jaxguard.format.spec import ReaderError

HASHES = {0: "sha256", 1: "blake3"}
NEW_FILE_HASH = "blake3"
HASH_FLAG_BITS = 0xFF
_LABELS = {"sha256": "SHA-256", "blake3": "BLAKE3"}


def hasher(name, *, all_cores=False):
    """A new hash object (``update``, ``digest``, ``hexdigest``, 32-byte digests) of an
    integrity hash.

    Numerical contract: ``sha256`` is hashlib's (FIPS 180-4), ``blake3`` the `blake3`
    package's default 32-byte BLAKE3 (the digest does not depend on its threads; both
    release the GIL on large inputs).

    Args:
      name: ``"sha256"`` or ``"blake3"`` (`HASHES`).
      all_cores: BLAKE3 hashes each large update on every core (for a hash nothing else
        runs beside: 5.5 GB/s on 2 cores against 3.2 on one); SHA-256 has one thread.

    Returns:
      The hash object.

    Raises:
      ReaderError: an unknown name, or BLAKE3 without the `blake3` package installed.
    """
    if name == "sha256":
        return hashlib.sha256()
    if name == "blake3":
        try:
            import blake3
        except ImportError:
            raise ReaderError("this container's integrity hash is BLAKE3 and the `blake3` package is not "
                              "installed; pip install blake3") from None
        return _Blake3(blake3.blake3(max_threads=blake3.blake3.AUTO if all_cores else 1))
    raise ReaderError(f"unknown integrity hash {str(name)[:40]!r}; this reader knows {', '.join(HASHES.values())}")


class _Blake3:
    """A `blake3.blake3` that takes any C-contiguous buffer, as hashlib does (it takes bytes only)."""

    def __init__(self, h):
        self.h = h

    def update(self, data):
        view = memoryview(data)
        self.h.update(view if view.format == "B" and view.ndim == 1 else view.cast("B"))

    def digest(self):
        return self.h.digest()

    def hexdigest(self):
        return self.h.hexdigest()


def hash_label(name) -> str:
    """How messages name an integrity hash (``SHA-256``, ``BLAKE3``).

    Args:
      name: a key of `HASHES`.
    """
    return _LABELS.get(name, str(name)[:40]) if isinstance(name, str) else str(name)[:40]


def hash_flags(name) -> int:
    """The prefix flags of a container whose integrity hash is `name`.

    Args:
      name: a key of `HASHES`.

    Raises:
      ReaderError: an unknown name.
    """
    for k, known in HASHES.items():
        if known == name:
            return k
    raise ReaderError(f"unknown integrity hash {str(name)[:40]!r}; this reader knows {', '.join(HASHES.values())}")


def header_hash(header) -> str:
    """The integrity hash a parsed header declares (``sha256`` when it names none).

    Args:
      header: the container's parsed JSON header.
    """
    return header.get("hash", "sha256")


def prefix_hash(flags) -> str:
    """The integrity hash a container's prefix flags name.

    Args:
      flags: the prefix's flags field.

    Raises:
      ReaderError: other flag bits set, or a hash id this reader does not know.
    """
    if flags & ~HASH_FLAG_BITS:
        raise ReaderError(f"unknown flags {flags:#x} in the container prefix")
    if flags not in HASHES:
        raise ReaderError(f"the container's integrity hash id {flags} is unknown to this reader "
                          f"(it knows {', '.join(f'{k} {v}' for k, v in HASHES.items())}); upgrade jaxguard to read it")
    return HASHES[flags]


def check_header_hash(header, name) -> None:
    """Refuse a header whose ``hash`` differs from the prefix's.

    Args:
      header: the container's parsed JSON header.
      name: the hash the prefix names (`prefix_hash`).

    Raises:
      ReaderError: the two disagree.
    """
    if header_hash(header) != name:
        raise ReaderError(f"the header declares integrity hash {str(header_hash(header))[:40]!r} but the prefix "
                          f"{name!r}; the file is inconsistent")


def decoded_mismatch(header) -> str:
    """The message of a decoded-moments digest that differs from the header's.

    Args:
      header: the container's parsed JSON header (it names the hash).
    """
    return f"decoded moments {hash_label(header_hash(header))} mismatch: the decoder disagrees with the writer"
