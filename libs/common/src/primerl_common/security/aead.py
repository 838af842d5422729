"""AES-256-GCM that runs on several cores at once: OpenSSL's libcrypto (the one Python's `ssl`
module uses) called through ctypes, letting go of the GIL for the cipher's pass over the bytes,
so K threads seal or open K messages in parallel. (The `cryptography` package holds the GIL: two
threads of it run slower than one.) The short calls around that pass (context, key, nonce,
associated data, tag) keep the GIL: each release is a hand-over that the event loop of a
process receiving a push waits on. Sealed streams (`primerl_common.security.sealed`) put weight
pushes on it.

A sealed message is the ciphertext followed by the 16-byte tag. `open_sealed` raises
`SealBroken` when the tag does not match the key, nonce, associated data and bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import ssl

__all__ = ["KEY_BYTES", "NONCE_BYTES", "TAG_BYTES", "SealBroken", "open_sealed", "seal"]

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
_CTRL_GCM_SET_IVLEN = 0x9
_CTRL_GCM_GET_TAG = 0x10
_CTRL_GCM_SET_TAG = 0x11


class SealBroken(ValueError):
    """A sealed message that does not open: a wrong key, nonce or associated data, or bytes
    changed on the way."""


def _loaded_libcrypto() -> str | None:
    """The path of the libcrypto this process loaded for Python's ssl module (Linux), if any."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcrypto.so" in line}
    except OSError:
        return None
    return min(paths) if paths else None


@functools.cache
def _libcrypto(keep_gil: bool = True) -> ctypes.CDLL:
    """libcrypto's AES-GCM functions: called holding the GIL (`keep_gil`, for the short calls),
    or letting go of it for the call (for the pass over a message's bytes)."""
    # The libcrypto Python's ssl module uses (loaded with `ssl`), else the system's by name.
    name = _loaded_libcrypto() or ctypes.util.find_library("crypto")
    if name is None:
        raise OSError(f"libcrypto not found (Python's ssl module uses {ssl.OPENSSL_VERSION})")
    lib = ctypes.PyDLL(name) if keep_gil else ctypes.CDLL(name)
    vp, ip, cp = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
    signatures = {
        "EVP_CIPHER_CTX_new": ([], vp),
        "EVP_CIPHER_CTX_free": ([vp], None),
        "EVP_aes_256_gcm": ([], vp),
        "EVP_CipherInit_ex": ([vp, vp, vp, cp, cp, ip], ip),
        "EVP_CIPHER_CTX_ctrl": ([vp, ip, ip, vp], ip),
        "EVP_CipherUpdate": ([vp, vp, ctypes.POINTER(ip), vp, ip], ip),
        "EVP_CipherFinal_ex": ([vp, vp, ctypes.POINTER(ip)], ip),
    }
    for function, (argtypes, restype) in signatures.items():
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = restype
    return lib


def _pointer(buffer: bytes | bytearray | memoryview) -> tuple[int, int, object]:
    """(address, length, the object to keep alive) of a contiguous buffer, without copying it
    (but a read-only buffer other than bytes, which is copied once)."""
    if not isinstance(buffer, bytes):
        view = memoryview(buffer).cast("B")
        if not view.readonly:
            return (ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0), len(view), view
        buffer = bytes(view)
    # ctypes maps only writable buffers; a bytes object's own data is reached through c_char_p.
    return ctypes.cast(ctypes.c_char_p(buffer), ctypes.c_void_p).value or 0, len(buffer), buffer


def _run(
    encrypt: bool, key: bytes, nonce: bytes, source: int, size: int, aad: bytes, target: int, tag: bytearray
) -> bool:
    if len(key) != KEY_BYTES or len(nonce) != NONCE_BYTES:
        raise ValueError(f"AES-256-GCM takes a {KEY_BYTES}-byte key and a {NONCE_BYTES}-byte nonce")
    lib = _libcrypto()
    ctx = lib.EVP_CIPHER_CTX_new()
    if not ctx:
        raise MemoryError("EVP_CIPHER_CTX_new failed")
    try:
        length = ctypes.c_int(0)
        mode = 1 if encrypt else 0
        ok = lib.EVP_CipherInit_ex(ctx, lib.EVP_aes_256_gcm(), None, None, None, mode)
        ok = ok and lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_SET_IVLEN, NONCE_BYTES, None)
        ok = ok and lib.EVP_CipherInit_ex(ctx, None, None, key, nonce, mode)
        if aad:
            ok = ok and lib.EVP_CipherUpdate(ctx, None, ctypes.byref(length), aad, len(aad))
        tag_buffer = (ctypes.c_char * TAG_BYTES).from_buffer(tag)
        if not encrypt:
            ok = ok and lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_SET_TAG, TAG_BYTES, tag_buffer)
        # EVP_CipherUpdate takes an int length: 1 GiB a call keeps it in range.
        step, update = 1 << 30, _libcrypto(keep_gil=False).EVP_CipherUpdate
        for start in range(0, size, step):
            count = min(step, size - start)
            ok = ok and update(ctx, target + start, ctypes.byref(length), source + start, count)
        if not ok:
            raise RuntimeError("libcrypto refused an AES-256-GCM step")
        final = (ctypes.c_char * 16)()
        if not lib.EVP_CipherFinal_ex(ctx, final, ctypes.byref(length)):
            return False  # only decryption fails here: the tag does not match
        if encrypt and not lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_GET_TAG, TAG_BYTES, tag_buffer):
            raise RuntimeError("libcrypto did not give the GCM tag")
        return True
    finally:
        lib.EVP_CIPHER_CTX_free(ctx)


def _new_bytes(size: int) -> bytes:
    """A bytes object of `size` bytes not yet written (the C API's PyBytes_FromStringAndSize
    with no source), for this module to fill before anyone else sees it: a sealed message is
    handed to gRPC as bytes without copying it once more."""
    return _bytes_of_size(None, size)


_bytes_of_size = ctypes.pythonapi.PyBytes_FromStringAndSize
_bytes_of_size.restype = ctypes.py_object
_bytes_of_size.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]


def seal(
    key: bytes, nonce: bytes, data: bytes | bytearray | memoryview, aad: bytes = b"", *, prefix: bytes = b""
) -> bytes:
    """`prefix` || AES-256-GCM of `data` || its 16-byte tag, as one bytes object. Never reuse a
    nonce with one key."""
    source, size, _keep = _pointer(data)
    sealed = _new_bytes(len(prefix) + size + TAG_BYTES)
    base = ctypes.cast(ctypes.c_char_p(sealed), ctypes.c_void_p).value or 0
    ctypes.memmove(base, prefix, len(prefix))
    tag = bytearray(TAG_BYTES)
    _run(True, key, nonce, source, size, aad, base + len(prefix), tag)
    ctypes.memmove(base + len(prefix) + size, bytes(tag), TAG_BYTES)
    return sealed


def open_sealed(
    key: bytes, nonce: bytes, sealed: bytes | bytearray | memoryview, aad: bytes = b"", *, offset: int = 0
) -> bytes:
    """The bytes `seal` sealed (from `offset` of `sealed` on); raises SealBroken if they, the key,
    nonce or aad differ."""
    source, total, _keep = _pointer(sealed)
    source, total = source + offset, total - offset
    if total < TAG_BYTES:
        raise SealBroken(f"a sealed message is at least its {TAG_BYTES}-byte tag, got {total} bytes")
    size = total - TAG_BYTES
    # Not zeroed first (a 4 MiB memset holding the GIL, per message): every byte is written below,
    # and on a tag that does not match the object is dropped unseen.
    data = _new_bytes(size)
    tag = bytearray(ctypes.string_at(source + size, TAG_BYTES))
    target = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
    if not _run(False, key, nonce, source, size, aad, target, tag):
        raise SealBroken("the sealed message does not open: its tag does not match (altered, or another key)")
    return data
