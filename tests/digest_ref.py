"""An independent definition of the chunk digest in NumPy, for the tests.

Written from the definition in csrc/include/pimhbm/digest.h, not from the kernels: the CPU and
CUDA kernels (through the FFI) must agree with it bit for bit.
"""

from __future__ import annotations

import numpy as np

_U64 = np.uint64
_U32 = np.uint32
CHUNK_STRIDE = _U64(0xD6E8FEB86659FD93)
MUL1 = _U64(0xFF51AFD7ED558CCD)
MUL2 = _U64(0xC4CEB9FE1A85EC53)
LENGTH_MUL = _U64(0x94D049BB133111EB)
_LOW31 = _U32(0x7FFFFFFF)


def word_muls(count: int) -> np.ndarray:
    """uint64 multipliers of words 0 .. count - 1 of a chunk (each below 2^32, odd)."""
    with np.errstate(over="ignore"):
        x = (np.arange(count, dtype=_U32) * _U32(0x5BD1E995) + _U32(0x6A09E667)) & _LOW31
        x = x ^ (x >> _U32(15))
        x = (x * _U32(0x2C1B3C6D)) & _LOW31
        x = x ^ (x >> _U32(13))
    return x.astype(_U64) * _U64(2) + _U64(1)


def _fmix33(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> _U64(33))
    x = x * MUL1
    x = x ^ (x >> _U64(33))
    x = x * MUL2
    return x ^ (x >> _U64(33))


def chunk_digests(raw: bytes | np.ndarray, chunk_bytes: int) -> np.ndarray:
    """uint32 (n, 2) digest table of a byte string, as pimhbm.scan returns it."""
    data = np.frombuffer(bytes(raw), dtype=np.uint8)
    nbytes = data.size
    n = -(-nbytes // chunk_bytes)
    out = np.zeros((n, 2), dtype=np.uint32)
    with np.errstate(over="ignore"):
        for c in range(n):
            piece = data[c * chunk_bytes:(c + 1) * chunk_bytes]
            length = piece.size
            padded = np.zeros(-(-length // 4) * 4, dtype=np.uint8)
            padded[:length] = piece
            words = padded.view("<u4").astype(_U64)
            acc = np.sum(words * word_muls(words.size), dtype=_U64)
            key = _U64(c + 1) * CHUNK_STRIDE
            d = _fmix33(np.array([acc + _U64(length) * LENGTH_MUL + key], dtype=_U64))[0]
            out[c, 0] = np.uint32(int(d) & 0xFFFFFFFF)
            out[c, 1] = np.uint32(int(d) >> 32)
    return out


def chunk_health(x: np.ndarray, chunk_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(nonfinite count, max finite |x| as float32) per chunk, from NumPy's own float semantics."""
    flat = np.ascontiguousarray(x).reshape(-1)
    per_chunk = chunk_bytes // flat.dtype.itemsize
    n = -(-flat.nbytes // chunk_bytes)
    counts = np.zeros(n, dtype=np.int32)
    maxima = np.zeros(n, dtype=np.float32)
    for c in range(n):
        piece = flat[c * per_chunk:(c + 1) * per_chunk].astype(np.float64)
        finite = np.isfinite(piece)
        counts[c] = np.count_nonzero(~finite)
        maxima[c] = np.float32(np.abs(piece[finite]).max()) if finite.any() else np.float32(0)
    return counts, maxima
