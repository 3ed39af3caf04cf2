# SPDX-License-Identifier: Apache-2.0
"""tmsdisk.store: this rank's store of named objects in tmsdiskd's files (C API version 6).

An object is a byte array with a name, kept by the daemon while the process runs (removed when it
exits). Reads and writes are asynchronous, from device or host memory, and ordered after the work
queued on a CUDA stream; each returns a Ticket to wait on. What streams an optimizer's state through
the step (tmsdisk.optim) is built on it.

    from tmsdisk import store
    handle = store.open("moments.0", tensor.numel() * tensor.element_size())
    store.write(handle, 0, tensor).wait()     # tensor must not change until the write is done
    store.read(handle, 0, tensor).wait()      # the committed bytes, after every write queued before

The module itself is the store object that tmsdisk.optim takes (`store=` argument): any object with
these functions (chunk_bytes, open, remove, write, read, prefetch, flush, returning tickets with
wait()) can stand in for it, as the tests' in-memory store does.

Failures raise tmsdisk.Error with the C API's errno and what to do about it.
"""

import ctypes
import errno as _errno

from . import Error
from . import _function as _package_function

__all__ = [
    "STORE_API_VERSION",
    "NAME_MAX",
    "NAME_RULE",
    "Ticket",
    "chunk_bytes",
    "flush",
    "open",
    "prefetch",
    "read",
    "remove",
    "write",
]

#: The C API version that brought the store (TMSDISK_API_VERSION 6).
STORE_API_VERSION = 6

#: Object names: 1 to NAME_MAX characters of A-Z a-z 0-9 _ . - (the daemon checks them).
NAME_MAX = 127
NAME_RULE = "an object name is 1 to %d characters of A-Z a-z 0-9 _ . -" % NAME_MAX

_U64P = ctypes.POINTER(ctypes.c_uint64)
_PROTOTYPES = {
    "tmsdisk_store_chunk_bytes": (ctypes.c_uint64, []),
    "tmsdisk_store_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_uint64, _U64P]),
    "tmsdisk_store_remove": (ctypes.c_int, [ctypes.c_char_p]),
    "tmsdisk_store_write": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, _U64P],
    ),
    "tmsdisk_store_read": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, _U64P],
    ),
    "tmsdisk_store_prefetch": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64]),
    "tmsdisk_store_wait": (ctypes.c_int, [ctypes.c_uint64]),
    "tmsdisk_store_flush": (ctypes.c_int, []),
}

# Where the daemon went away from a running rank, what it committed stays in the rank's files and the
# shim reconnects by itself: said with each of the errors that a lost daemon gives.
_COMES_BACK = (
    "what earlier writes committed stays in the rank's files, and the next call reconnects once the daemon "
    "is back on the same roots and socket"
)
_NO_DAEMON = (
    "the store lives in tmsdiskd and no daemon answers: run the program under `tmsctl run -- CMD` with "
    "the daemon running (`tmsctl doctor` says why it cannot be reached); if it was running, it exited: "
    + _COMES_BACK
)
_LOST = "the connection to tmsdiskd was lost (the daemon exited) and this operation did not complete: " + _COMES_BACK

# What to do, by errno, for the errors the C API documents; any call may meet the daemon's absence.
_HINTS = {
    _errno.ECONNREFUSED: _NO_DAEMON,
    _errno.ENOTCONN: _NO_DAEMON,
    _errno.ECONNRESET: _LOST,
    _errno.EPIPE: _LOST,
    _errno.ECONNABORTED: _LOST,
    _errno.EINVAL: (
        "%s; offsets are multiples of chunk_bytes() and ranges lie inside the object; a ticket is waited "
        "for once" % NAME_RULE
    ),
    _errno.EDQUOT: "over the daemon's max-chunks-per-uid for this user: remove objects no longer needed",
    _errno.ENOSPC: "the daemon's disk has no room: free space under its root or remove objects",
    _errno.ENODATA: "that range was never written: write it before reading it",
    _errno.EBADMSG: "a chunk failed verification against its checksum: the stored bytes are damaged",
}


def _function(call: str, name: str):
    """The C function `name` of the loaded libtmsdisk.so (the package's lookup, which says which API
    version a library without it predates) with this module's prototype set."""
    fn = _package_function(call, name)
    restype, argtypes = _PROTOTYPES[name]
    if fn.restype is not restype or fn.argtypes != argtypes:
        fn.restype, fn.argtypes = restype, argtypes
    return fn


def _error(rc: int, call: str, hint: str = "") -> Error:
    err = -rc
    if not hint:
        hint = _HINTS.get(err, "")
        if err == _errno.ENOENT and not call.startswith("tmsdisk.store.remove"):
            hint = _NO_DAEMON
    return Error(err, call, hint)


def _encode_name(name, call: str) -> bytes:
    """The name as the C API takes it; the daemon judges it, except what C could not see (no string, a
    NUL, characters beyond ASCII)."""
    if isinstance(name, str) and "\0" not in name:
        try:
            return name.encode("ascii")
        except UnicodeEncodeError:
            pass
    raise Error(_errno.EINVAL, call, "%r: %s" % (name, NAME_RULE))


class Ticket:
    """One queued read or write. wait() blocks until it is done and raises its error, if any.

    The ticket keeps the tensor it was given alive until then: the store reads or writes its memory
    until the operation is done. Waiting again returns (or raises) the same outcome.
    """

    __slots__ = ("id", "call", "_memory", "_rc")

    def __init__(self, ticket_id: int, call: str, memory=None):
        self.id = ticket_id
        self.call = call
        self._memory = memory
        self._rc = None

    @property
    def done(self) -> bool:
        """Whether wait() was called (and so whether the operation is known to be done)."""
        return self._rc is not None

    def wait(self) -> None:
        if self._rc is None:
            # The C API answers -EINVAL to a second wait: the outcome is kept here instead.
            self._rc = _function(self.call, "tmsdisk_store_wait")(self.id)
            self._memory = None
        if self._rc < 0:
            raise _error(self._rc, self.call)

    def __repr__(self):
        state = "pending" if self._rc is None else ("ok" if self._rc == 0 else "failed %d" % -self._rc)
        return "<tmsdisk.store.Ticket %d %s: %s>" % (self.id, state, self.call)


def chunk_bytes() -> int:
    """The chunk size of this rank's session: offsets of reads and writes are multiples of it.

    Raises Error (ENOTCONN) when there is no session with the daemon (the C API answers 0).
    """
    call = "tmsdisk.store.chunk_bytes()"
    size = _function(call, "tmsdisk_store_chunk_bytes")()
    if size == 0:
        raise Error(_errno.ENOTCONN, call, _NO_DAEMON)
    return size


def open(name: str, nbytes: int) -> int:  # pylint: disable=redefined-builtin
    """The handle of object `name`, created with `nbytes` bytes when missing.

    Raises Error: EEXIST when it exists with another size (remove it first), EINVAL for a bad name or
    size, EDQUOT over the user's quota, ECONNREFUSED or ENOENT without a daemon.
    """
    call = "tmsdisk.store.open(%r, %d)" % (name, nbytes)
    encoded = _encode_name(name, call)
    handle = ctypes.c_uint64()
    rc = _function(call, "tmsdisk_store_open")(encoded, nbytes, ctypes.byref(handle))
    if rc < 0:
        hint = ""
        if rc == -_errno.EEXIST:
            hint = "it exists with another size: remove it (tmsdisk.store.remove) or use another name"
        raise _error(rc, call, hint)
    return handle.value


def remove(name: str) -> None:
    """Deletes object `name` and frees its space. Raises Error (ENOENT) if there is none."""
    call = "tmsdisk.store.remove(%r)" % (name,)
    rc = _function(call, "tmsdisk_store_remove")(_encode_name(name, call))
    if rc < 0:
        raise _error(rc, call, "no object has this name" if rc == -_errno.ENOENT else "")


def _memory(what: str, memory, nbytes, stream):
    """(address, length, stream handle) of a tensor (contiguous; its CUDA device's current stream unless
    `stream` is given) or of an address with nbytes."""
    if hasattr(memory, "data_ptr") and hasattr(memory, "element_size"):
        if not memory.is_contiguous():
            raise ValueError("%s: the tensor is not contiguous; pass tensor.contiguous() and copy back" % what)
        size = memory.numel() * memory.element_size()
        if nbytes is None:
            nbytes = size
        elif nbytes > size:
            raise ValueError("%s: nbytes=%d is more than the tensor's %d bytes" % (what, nbytes, size))
        if stream is None and getattr(memory, "is_cuda", False):
            import torch  # pylint: disable=import-outside-toplevel

            stream = torch.cuda.current_stream(memory.device)
        address = memory.data_ptr()
    else:
        if nbytes is None:
            raise ValueError("%s: an address needs nbytes" % what)
        address = int(memory)
    stream = getattr(stream, "cuda_stream", stream)  # a torch.cuda.Stream, or a CUstream as an int
    return address, nbytes, (stream or None)


def _transfer(kind: str, handle: int, offset: int, memory, nbytes, stream) -> Ticket:
    call = "tmsdisk.store.%s(%d, %d)" % (kind, handle, offset)
    address, length, cu_stream = _memory(call, memory, nbytes, stream)
    call = "tmsdisk.store.%s(%d, %d, %d bytes)" % (kind, handle, offset, length)
    ticket = ctypes.c_uint64()
    rc = _function(call, "tmsdisk_store_" + kind)(handle, offset, address, length, cu_stream, ctypes.byref(ticket))
    if rc < 0:
        raise _error(rc, call)
    return Ticket(ticket.value, call, memory)


def write(handle: int, offset: int, src, nbytes=None, *, stream=None) -> Ticket:
    """Queues a write of `src` (a contiguous tensor, or an address with nbytes) to the object at offset.

    Ordered after the work queued until now on `stream` (default: the tensor's device's current stream,
    none for host memory). All or nothing: readers see the old bytes or the new ones. `src` must not
    change until the ticket is waited for.
    """
    return _transfer("write", handle, offset, src, nbytes, stream)


def read(handle: int, offset: int, dst, nbytes=None, *, stream=None) -> Ticket:
    """Queues a read of the object's bytes at offset into `dst` (a contiguous tensor, or an address with
    nbytes), after the work queued on `stream` and every write queued before. `dst` holds them once the
    ticket is waited for (Error ENODATA if they were never written)."""
    return _transfer("read", handle, offset, dst, nbytes, stream)


def prefetch(handle: int, offset: int, nbytes: int) -> None:
    """A hint that [offset, offset + nbytes) of the object will be read soon (an object in the host tier
    is close already; one on disk is read by the read itself)."""
    call = "tmsdisk.store.prefetch(%d, %d, %d)" % (handle, offset, nbytes)
    rc = _function(call, "tmsdisk_store_prefetch")(handle, offset, nbytes)
    if rc < 0:
        raise _error(rc, call)


def flush() -> None:
    """Blocks until every write queued so far is done; raises the first error among them."""
    call = "tmsdisk.store.flush()"
    rc = _function(call, "tmsdisk_store_flush")()
    if rc < 0:
        raise _error(rc, call)
