# SPDX-License-Identifier: Apache-2.0
"""tmsdisk: pause this process's GPU memory to disk, whole or by tag, from Python.

Pure Python over the C API of libtmsdisk.so (interposer/include/tmsdisk.h), which must be loaded in
this process: run the program under `tmsctl run -- ...` (or with LD_PRELOAD naming libtmsdisk.so).

    import tmsdisk
    with tmsdisk.region("weights"):             # backed up on pause, restored on resume
        weights = allocate(...)
    with tmsdisk.region("kv_cache", "discard"):  # released on pause, zero-filled on resume
        cache = allocate(...)
    tmsdisk.pause("kv_cache")
    tmsdisk.pause("weights")   # or tmsdisk.pause(): everything, untagged memory included
    print(tmsdisk.status())
    tmsdisk.resume()

Its parts: tmsdisk.store, the rank's store of named objects in the daemon's files, and tmsdisk.optim,
Adam and AdamW whose state lives there and streams through the step (imported on first use: it
imports torch). tmsdisk.on_pause(fn) runs fn before each pause, to hand back memory a pause need not move.

Every failure raises tmsdisk.Error, an OSError whose errno is the shim's and whose text carries the
shim's own message; NotLoadedError (also an Error) when libtmsdisk.so is not in this process. The C
functions are called through ctypes.CDLL, which releases the GIL while they run: a pause waits for the
callbacks registered with tmsdisk_on_pause (PyTorch's empty_cache, from tmsdisk's start-up module),
which take the GIL on a thread of the shim.
"""

import ctypes
import errno as _errno
import os
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

__all__ = [
    "API_VERSION",
    "BACKUP",
    "DISCARD",
    "RESIDENT",
    "UNTAGGED",
    "TAG_MAX",
    "TAG_RULE",
    "Error",
    "NotLoadedError",
    "TagError",
    "Status",
    "TagStatus",
    "disabled",
    "library_path",
    "loaded",
    "on_pause",
    "pause",
    "prefetch",
    "read_paused",
    "region",
    "retain_host_copy",
    "resume",
    "set_backup_dir",
    "status",
    "store",
    "tags",
    "version",
]

#: The C API version this package is written against (TMSDISK_API_VERSION; tags came with 4, a tag's
#: resume with accept_loss with 5, the store of named objects with 6, paused memory read in place with 7,
#: the rank's directory of its own choosing with 8).
API_VERSION = 8

#: Policies (TMSDISK_POLICY_*): what a pause does with a tag's allocations.
BACKUP = "backup"  # saved (host tier, disk) and restored bit for bit
DISCARD = "discard"  # released unsaved; the resume maps zero-filled memory at the same addresses
RESIDENT = "resident"  # never paused
_POLICY_CODES = {BACKUP: 0, DISCARD: 1, RESIDENT: 2}
_POLICY_NAMES = {code: name for name, code in _POLICY_CODES.items()}

#: The tag of allocations made outside any region (TMSDISK_UNTAGGED).
UNTAGGED = "untagged"
#: Tag names: 1 to TAG_MAX characters of A-Z a-z 0-9 _ . - (TMSDISK_TAG_MAX; the shim checks them).
TAG_MAX = 63
TAG_RULE = "a tag name is 1 to %d characters of A-Z a-z 0-9 _ . -" % TAG_MAX

# tmsdisk_status.state and the indexes of unmanaged_bytes (TMSDISK_STATE_*, TMSDISK_UNMANAGED_*), named
# as `tmsctl status` names them.
_STATES = ("running", "pausing", "paused", "resuming", "partially-paused")
_UNMANAGED = ("small", "exported", "imported", "multicast", "pool", "managed-memory", "other", "resident-by-request")


class Error(OSError):
    """A call of libtmsdisk.so failed.

    errno and strerror as for any OSError; `call` names the Python call that failed, and `message` is
    what the shim said about it (tmsdisk_status().last_message for a pause or resume), or "".
    """

    def __init__(self, err: int, call: str, message: str = ""):
        text = "%s: %s" % (call, os.strerror(err))
        if message:
            text += ": " + message
        super().__init__(err, text)
        self.call = call
        self.message = message


class TagError(Error, ValueError):
    """A tag name or policy that the C API refuses (errno EINVAL); also a ValueError."""


class NotLoadedError(Error):
    """libtmsdisk.so is not loaded in this process (errno ELIBACC)."""

    def __init__(self, call: str, message: str):
        super().__init__(_errno.ELIBACC, call, message)


# --- the C API -------------------------------------------------------------------------------------


class _CStatus(ctypes.Structure):
    _fields_ = [
        ("state", ctypes.c_uint32),
        ("connected", ctypes.c_uint32),
        ("enabled", ctypes.c_uint32),
        ("managed_allocations", ctypes.c_uint32),
        ("paused_allocations", ctypes.c_uint32),
        ("last_error", ctypes.c_int32),
        ("session_id", ctypes.c_uint64),
        ("resident_bytes", ctypes.c_uint64),
        ("paused_bytes", ctypes.c_uint64),
        ("unmanaged_bytes", ctypes.c_uint64 * len(_UNMANAGED)),
        ("last_pause_bytes", ctypes.c_uint64),
        ("last_pause_ns", ctypes.c_uint64),
        ("last_resume_bytes", ctypes.c_uint64),
        ("last_resume_ns", ctypes.c_uint64),
        ("last_message", ctypes.c_char * 256),
        ("damaged_allocations", ctypes.c_uint32),
        ("damaged_bytes", ctypes.c_uint64),
    ]


class _CTagInfo(ctypes.Structure):
    _fields_ = [
        ("tag", ctypes.c_char * 64),
        ("policy", ctypes.c_uint32),
        ("allocations", ctypes.c_uint32),
        ("paused_allocations", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("resident_bytes", ctypes.c_uint64),
        ("paused_bytes", ctypes.c_uint64),
    ]


_PROTOTYPES = {
    "tmsdisk_pause": (ctypes.c_int, []),
    "tmsdisk_resume": (ctypes.c_int, []),
    "tmsdisk_resume_accept_loss": (ctypes.c_int, []),
    "tmsdisk_status": (ctypes.c_int, [ctypes.POINTER(_CStatus), ctypes.c_size_t]),
    "tmsdisk_version": (ctypes.c_char_p, []),
    # API version 3
    "tmsdisk_on_pause": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p]),
    # API version 4
    "tmsdisk_tag_push": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
    "tmsdisk_tag_pop": (ctypes.c_int, []),
    "tmsdisk_pause_tag": (ctypes.c_int, [ctypes.c_char_p]),
    "tmsdisk_resume_tag": (ctypes.c_int, [ctypes.c_char_p]),
    # API version 5
    "tmsdisk_resume_tag_accept_loss": (ctypes.c_int, [ctypes.c_char_p]),
    "tmsdisk_tags": (ctypes.c_int, [ctypes.POINTER(_CTagInfo), ctypes.c_size_t, ctypes.c_size_t]),
    # API version 7
    "tmsdisk_read_paused": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p]),
    "tmsdisk_paused_view": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p)]),
    "tmsdisk_prefetch": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
    "tmsdisk_retain_host_copy": (ctypes.c_int, [ctypes.c_int]),
    # API version 8
    "tmsdisk_set_backup_dir": (ctypes.c_int, [ctypes.c_char_p]),
}

# The API version each function came with (the others were there from the first): what a library
# without one predates.
_SINCE = {
    "tmsdisk_on_pause": 3,
    "tmsdisk_tag_push": 4,
    "tmsdisk_tag_pop": 4,
    "tmsdisk_pause_tag": 4,
    "tmsdisk_resume_tag": 4,
    "tmsdisk_resume_tag_accept_loss": 5,
    "tmsdisk_tags": 5,
    "tmsdisk_read_paused": 7,
    "tmsdisk_paused_view": 7,
    "tmsdisk_prefetch": 7,
    "tmsdisk_retain_host_copy": 7,
    "tmsdisk_set_backup_dir": 8,
}

_NOT_LOADED = (
    "libtmsdisk.so is not loaded in this process: run the program under `tmsctl run -- CMD`, or start it "
    "with LD_PRELOAD=/path/to/libtmsdisk.so (`tmsctl env` prints the environment)"
)

_load_lock = threading.Lock()
_lib = None  # the ctypes.CDLL of the loaded libtmsdisk.so, once found
_lib_path = None


def _mapped_shims() -> List[str]:
    """Paths of libtmsdisk.so files mapped into this process (loaded without RTLD_GLOBAL, say)."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if os.path.basename(path).startswith("libtmsdisk.so") and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def _find(call: str):
    """(the loaded libtmsdisk.so as a ctypes.CDLL, its path or None); NotLoadedError if none is loaded.

    ctypes.CDLL, never PyDLL: its calls release the GIL, which a pause's callbacks need.
    """
    here = ctypes.CDLL(None)  # the global scope: the executable, LD_PRELOAD, RTLD_GLOBAL libraries
    if hasattr(here, "tmsdisk_pause"):
        mapped = _mapped_shims()
        return here, (mapped[0] if mapped else None)
    # Loaded but not global, or named by TMSDISK_LIBRARY. Only a library this process has loaded already
    # is taken (RTLD_NOLOAD): one loaded now would see none of the CUDA calls, which bind to libcuda
    # without it, and would pause nothing.
    candidates = _mapped_shims()
    named = os.environ.get("TMSDISK_LIBRARY")
    if named:
        candidates.append(named)
    for path in candidates:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        except OSError:
            continue
        if hasattr(lib, "tmsdisk_pause"):
            return lib, path
    why = _NOT_LOADED
    if named:
        why += (
            " (TMSDISK_LIBRARY=%s names a library this process has not loaded; loaded now it would not see "
            "the CUDA calls: it must be preloaded)" % named
        )
    raise NotLoadedError(call, why)


def _load(call: str):
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _load_lock:
        if _lib is None:
            lib, path = _find(call)
            for name, (restype, argtypes) in _PROTOTYPES.items():
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.restype, fn.argtypes = restype, argtypes
            _lib_path = path
            _lib = lib
    return _lib


def _function(call: str, name: str):
    lib = _load(call)
    fn = getattr(lib, name, None)
    if fn is None:
        raise Error(
            _errno.ENOSYS,
            call,
            "the loaded libtmsdisk.so (%s) has no %s: it predates API version %d; use the tmsctl and "
            "libtmsdisk.so of the same tmsdisk as this package"
            % (version(), name, _SINCE.get(name, 6 if name.startswith("tmsdisk_store_") else API_VERSION)),
        )
    return fn


def loaded() -> bool:
    """Whether libtmsdisk.so is loaded in this process (and so whether the other calls can work)."""
    try:
        _load("tmsdisk.loaded")
    except NotLoadedError:
        return False
    return True


def library_path() -> Optional[str]:
    """The path of the loaded libtmsdisk.so (None if it cannot be told); NotLoadedError if none is."""
    _load("tmsdisk.library_path")
    return _lib_path


def version() -> str:
    """The loaded library's version string, "tmsdisk X.Y.Z"."""
    return _load("tmsdisk.version").tmsdisk_version().decode("utf-8", "replace")


# --- pause and resume ------------------------------------------------------------------------------


def _bad_tag(tag, call: str) -> "TagError":
    return TagError(_errno.EINVAL, call, "%r: %s" % (tag, TAG_RULE))


def _encode_tag(tag, call: str) -> bytes:
    """The name as the C API takes it; the shim judges it (-EINVAL), except what C could not even see:
    no string, a NUL (C would read the name up to it), or characters beyond ASCII."""
    if isinstance(tag, str) and "\0" not in tag:
        try:
            return tag.encode("ascii")
        except UnicodeEncodeError:
            pass
    raise _bad_tag(tag, call)


def _last_message() -> str:
    try:
        return _c_status().last_message.decode("utf-8", "replace")
    except Error:
        return ""


def _pause_resume(call: str, rc: int, tag=None):
    if rc == -_errno.EINVAL and tag is not None:
        raise _bad_tag(tag, call)
    if rc < 0:
        raise Error(-rc, call, _last_message())


def pause(tag: Optional[str] = None) -> None:
    """Pauses this process's memory carrying `tag` (None: all of it, untagged memory included).

    Blocks until done. A tag no allocation carries is nothing to do. Memory of `backup` tags is saved and
    released, that of `discard` tags released; virtual addresses stay valid. Raises Error (EBUSY when
    another pause or resume runs, or when another tag's backed-up pause did not complete: resume it
    first; ENOSPC when the disk has no room, nothing changed; ECONNREFUSED or ENOENT when no
    daemon answers...), with the shim's message.
    """
    if tag is None:
        call = "tmsdisk.pause()"
        _pause_resume(call, _function(call, "tmsdisk_pause")())
    else:
        call = "tmsdisk.pause(%r)" % (tag,)
        name = _encode_tag(tag, call)
        _pause_resume(call, _function(call, "tmsdisk_pause_tag")(name), tag)


def resume(tag: Optional[str] = None, accept_loss: bool = False) -> None:
    """Brings back the paused memory carrying `tag` (None: all of it) at its addresses.

    Backed-up memory is verified against its checksums; discarded memory comes back zero-filled. Raises
    Error (EBADMSG, EIO, ENODATA: a backup is damaged, that memory stays paused and status() says which).
    accept_loss=True gives memory whose backup is damaged zero-filled memory instead (with a tag: that
    tag's only, as `tmsctl resume --tag TAG --accept-loss` does): its data is lost.
    """
    if tag is None:
        call = "tmsdisk.resume(accept_loss=True)" if accept_loss else "tmsdisk.resume()"
        name = "tmsdisk_resume_accept_loss" if accept_loss else "tmsdisk_resume"
        _pause_resume(call, _function(call, name)())
        return
    call = "tmsdisk.resume(%r%s)" % (tag, ", accept_loss=True" if accept_loss else "")
    name = _encode_tag(tag, call)
    function = "tmsdisk_resume_tag_accept_loss" if accept_loss else "tmsdisk_resume_tag"
    _pause_resume(call, _function(call, function)(name), tag)


# --- before a pause --------------------------------------------------------------------------------

_LOG_LEVELS = ("error", "warn", "info", "debug")
_on_pause_lock = threading.Lock()
_on_pause_functions = []  # what on_pause() was given, in order
_on_pause_c_callback = None  # the package's one tmsdisk_on_pause callback; the shim keeps its pointer for good


def prefetch(tag: Optional[str] = None, wait: bool = False) -> bool:
    """Starts reading the paused memory of `tag` (None: all of it) from disk into the node's host tier
    ahead of its resume, as far as this rank's share of the tier goes (tmsdisk_prefetch): the resume
    then copies that part from memory and reads only the rest from disk. It runs in the background; a
    pause or resume that comes meanwhile goes first and ends it, using what was read by then. With
    wait=True, returns once it ended. False when the node's tier has no room for this rank now (the
    resume reads from disk, as without a prefetch); else True. Raises Error: ENOTSUP with the host tier
    off for this process; with wait, what stopped it (EBADMSG: a chunk failed verification)."""
    call = "tmsdisk.prefetch(%r)" % (tag,) if tag is not None else "tmsdisk.prefetch()"
    name = _encode_tag(tag, call) if tag is not None else None
    rc = _function(call, "tmsdisk_prefetch")(name, 1 if wait else 0)
    if rc == -_errno.EINVAL and tag is not None:
        raise _bad_tag(tag, call)
    if rc == -_errno.ENOSPC:
        return False
    if rc < 0:
        hints = {_errno.ENOTSUP: "the host tier is off for this process (TMSDISK_HOST_TIER=0)"}
        raise Error(-rc, call, hints.get(-rc, "the process's tmsdisk log (stderr) says why"))
    return True


def set_backup_dir(path: str) -> None:
    """The directory this process's files go in from now on (tmsdisk_set_backup_dir; torch_memory_saver's
    set_disk_backup_dir): one of the caller's own, writable by no one else, on a disk. The process opens
    it and hands tmsdiskd the descriptor; its files are then named "tmsdisk-<job>-rank<R>-<pid>.*" in it,
    beside anything else there, and removed when the process exits. Raises Error: EBUSY while any of its
    memory is paused or it stores objects (its files stay where they are), EACCES (not the caller's
    directory, or writable by others), EINVAL (on tmpfs, which tmsdiskd refuses unless allowed),
    ENOENT/ENOTDIR."""
    call = "tmsdisk.set_backup_dir(%r)" % (path,)
    rc = _function(call, "tmsdisk_set_backup_dir")(os.fsencode(path))
    if rc < 0:
        hints = {
            _errno.EBUSY: "resume first, and choose the directory before the first object is stored",
            _errno.EACCES: "name a directory of your own that only you may write (chmod go-w)",
            _errno.EINVAL: "tmsdiskd refuses a directory in memory (tmpfs): name one on a disk",
            _errno.ENOENT: "create the directory first",
        }
        raise Error(-rc, call, hints.get(-rc, "the process's tmsdisk log (stderr) says why"))


def retain_host_copy(on: Optional[bool] = None) -> bool:
    """Whether a resume leaves the host chunks it copied back in the node's host tier, readable with
    read_paused() as the resumed memory's retained copy (as it was when paused) until that memory is
    used again: the next pause, a prefetch, or the daemon asking for it back (tmsdisk_retain_host_copy;
    torch_memory_saver's retain_cpu_backup). A copy read with zero_copy=True is kept in its view past
    that, until the memory is freed or resumed without retaining. on=True/False sets it; returns the
    setting before."""
    return _function("tmsdisk.retain_host_copy()", "tmsdisk_retain_host_copy")(-1 if on is None else int(on)) == 1


def read_paused(tensor, zero_copy: bool = False):
    """The bytes of a paused CUDA tensor, as a CPU tensor of its dtype and shape, without resuming it;
    None when it is resident (the device holds its bytes; unless retain_host_copy() kept its host copy)
    or was paused without a backup (a discard tag).

    Its chunks come from the node's host tier, from disk (verified against their seals) or are zero.
    zero_copy=True returns, where no chunk of the tensor lies on disk, a read-only tensor over the host
    copy itself (pinned where the whole allocation has one), at an address that stays the same while
    the tensor has a host copy: paused, resumed with retain_host_copy(), and in its later pauses; it
    goes when the memory is freed or resumed without retaining (do not read it after). Elsewhere a
    copy, as without it. A tensor being paused or resumed is read once that is done. (torch_memory_saver's
    get_cpu_backup.)"""
    import torch  # pylint: disable=import-outside-toplevel

    call = "tmsdisk.read_paused()"
    if not tensor.is_contiguous():
        raise ValueError("%s: the tensor must be contiguous (its bytes one range of memory)" % call)
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    if zero_copy:
        view = ctypes.c_void_p()
        rc = _function(call, "tmsdisk_paused_view")(tensor.data_ptr(), nbytes, ctypes.byref(view))
        if rc == 0:
            memory = (ctypes.c_uint8 * nbytes).from_address(view.value)
            return torch.frombuffer(memory, dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)
        if rc != -_errno.ENODATA:
            raise _read_paused_error(rc, call)
    out = torch.empty(nbytes, dtype=torch.uint8)
    rc = _function(call, "tmsdisk_read_paused")(tensor.data_ptr(), nbytes, out.data_ptr())
    if rc == -_errno.ENODATA:
        return None
    if rc < 0:
        raise _read_paused_error(rc, call)
    return out.view(tensor.dtype).view(tensor.shape)


def _read_paused_error(rc: int, call: str) -> "Error":
    hints = {
        _errno.EINVAL: "the tensor is not in memory tmsdisk manages (such memory stays on the device: read it there)",
        _errno.EBADMSG: "a chunk on disk failed verification against its seal: the backup is damaged",
    }
    return Error(-rc, call, hints.get(-rc, "the process's tmsdisk log (stderr) says why"))


def _log(level: str, message: str) -> None:
    """As the shim logs: to stderr, up to the level TMSDISK_LOG names (default warn)."""
    wanted = os.environ.get("TMSDISK_LOG", "warn").strip().lower()
    if wanted in _LOG_LEVELS and _LOG_LEVELS.index(level) <= _LOG_LEVELS.index(wanted):
        os.write(2, ("[tmsdisk %d] %s: python: %s\n" % (os.getpid(), level, message)).encode("utf-8", "replace"))


def _run_on_pause(_arg) -> None:
    for function in list(_on_pause_functions):
        try:
            function()
        except BaseException as e:  # pylint: disable=broad-except
            # Raised into ctypes it would be printed as "Exception ignored"; the pause goes on anyway,
            # moving what the function did not hand back.
            _log("warn", "before pause: %s raised %r; the pause goes on" % (getattr(function, "__qualname__", function), e))


def on_pause(function) -> None:
    """Runs function() before each pause of this process, to hand back memory the pause need not move.

    The shim's rules for tmsdisk_on_pause (tmsdisk.h) hold: it runs on a thread of the shim, not on the
    thread that pauses, before CUDA calls are held, and only for a pause that has work to do; it must
    return promptly and must not wait for anything a thread that pauses may hold (a lock of the
    program's, a CUDA stream it keeps busy). What it raises is logged, and the pause goes on. Functions
    run in the order given, all of them through one callback of this package's; there is no way to
    unregister one: give a function that finds what it acts on (through weak references) rather than
    one that keeps it alive. The same function given twice runs once.
    """
    global _on_pause_c_callback
    call = "tmsdisk.on_pause(%s)" % getattr(function, "__qualname__", repr(function))
    if not callable(function):
        raise TypeError("%s: not callable" % call)
    register = _function(call, "tmsdisk_on_pause")
    with _on_pause_lock:
        if _on_pause_c_callback is None:
            c_callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_run_on_pause)
            rc = register(ctypes.cast(c_callback, ctypes.c_void_p), None)
            if rc < 0:
                why = {_errno.ENOSPC: "the process has 16 pause callbacks registered already, the most there may be"}
                raise Error(-rc, call, why.get(-rc, ""))
            _on_pause_c_callback = c_callback
        if function not in _on_pause_functions:
            _on_pause_functions.append(function)


# --- regions ---------------------------------------------------------------------------------------

_thread = threading.local()  # .regions: this thread's open regions, [(tag, policy)], innermost last


def _regions() -> list:
    stack = getattr(_thread, "regions", None)
    if stack is None:
        stack = _thread.regions = []
    return stack


class _Region:
    """tmsdisk_tag_push on entry, tmsdisk_tag_pop on exit, exceptions or not; nestable."""

    def __init__(self, call: str, tag: str, policy: str):
        self._call = call
        if policy not in _POLICY_CODES:
            raise TagError(
                _errno.EINVAL, call, "%r is not a policy: %s" % (policy, ", ".join(repr(p) for p in _POLICY_CODES))
            )
        self._name = _encode_tag(tag, call)
        self._code = _POLICY_CODES[policy]
        self.tag = tag
        self.policy = policy

    def __enter__(self):
        rc = _function(self._call, "tmsdisk_tag_push")(self._name, self._code)
        if rc == -_errno.EINVAL:
            raise _bad_tag(self.tag, self._call)  # the policy is one of ours: the name it is
        if rc < 0:
            why = {_errno.ENOSPC: "regions nest 32 deep at most, and a process has at most 1023 tags"}
            raise Error(-rc, self._call, why.get(-rc, ""))
        _regions().append((self.tag, self.policy))
        return self

    def __exit__(self, exc_type, exc, tb):
        stack = _regions()
        if stack:
            stack.pop()
        rc = _function(self._call, "tmsdisk_tag_pop")()
        if rc < 0 and exc_type is None:
            # Only a pop made behind this package's back (tmsdisk_tag_pop through ctypes) gets here.
            raise Error(-rc, self._call, "this thread's region was already closed (by tmsdisk_tag_pop?)")
        return False


def region(tag: str, policy: str = BACKUP):
    """A context manager: device memory this thread allocates inside carries `tag` and `policy`.

    policy: "backup" (a pause saves it, a resume restores it), "discard" (a pause releases it unsaved, a
    resume maps zero-filled memory at the same addresses: a KV cache, scratch) or "resident" (never
    paused). Regions nest; the innermost one counts. Only the calling thread is affected: memory other
    threads allocate meanwhile is untagged (or carries their own regions' tags). Memory carries the tag
    it was allocated with for life: a caching allocator (PyTorch's) that hands out inside a region memory
    it obtained outside does not retag it; torch_memory_saver's compatibility module gives each region a
    private pool for that reason.
    """
    return _Region("tmsdisk.region(%r, %r)" % (tag, policy), tag, policy)


def disabled():
    """A context manager: device memory this thread allocates inside is never paused (policy "resident").

    It keeps the name of the innermost region opened through this package, if any.
    """
    stack = _regions()
    tag = stack[-1][0] if stack else UNTAGGED
    return _Region("tmsdisk.disabled()", tag, RESIDENT)


# --- status ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TagStatus:
    """The managed memory carrying one tag with one policy (struct tmsdisk_tag_info)."""

    tag: str
    policy: str  # "backup" or "discard" (never paused memory: Status.unmanaged_bytes["resident-by-request"])
    allocations: int
    paused_allocations: int
    resident_bytes: int
    paused_bytes: int


@dataclass(frozen=True)
class Status:
    """This process as the shim sees it (struct tmsdisk_status), and its memory by tag and policy."""

    state: str  # "running", "pausing", "paused", "resuming" or "partially-paused"
    connected: bool  # a session with tmsdiskd is open
    enabled: bool  # libcuda was found and the shim manages allocations
    managed_allocations: int
    paused_allocations: int
    last_error: int  # errno of the last pause or resume, 0 if it succeeded
    session_id: int
    resident_bytes: int  # managed bytes in GPU memory
    paused_bytes: int  # managed bytes paused
    unmanaged_bytes: Dict[str, int]  # resident for good, by reason: "small", ..., "resident-by-request"
    last_pause_bytes: int
    last_pause_ns: int
    last_resume_bytes: int
    last_resume_ns: int
    last_message: str  # what the last pause or resume said
    damaged_allocations: int  # paused memory a resume could not restore (damaged backup)
    damaged_bytes: int
    tags: Tuple[TagStatus, ...]  # one per (tag, policy) that managed memory carries

    def tag(self, name: str) -> Optional[TagStatus]:
        """The figures of tag `name`, over its policies (policy "backup+discard" when both), or None."""
        rows = [t for t in self.tags if t.tag == name]
        if not rows:
            return None
        return TagStatus(
            tag=name,
            policy="+".join(sorted({t.policy for t in rows})),
            allocations=sum(t.allocations for t in rows),
            paused_allocations=sum(t.paused_allocations for t in rows),
            resident_bytes=sum(t.resident_bytes for t in rows),
            paused_bytes=sum(t.paused_bytes for t in rows),
        )


def _c_status(call: str = "tmsdisk.status()") -> _CStatus:
    out = _CStatus()
    rc = _function(call, "tmsdisk_status")(ctypes.byref(out), ctypes.sizeof(out))
    if rc < 0:
        raise Error(-rc, call)
    return out


def tags() -> List[TagStatus]:
    """One TagStatus per (tag, policy) that managed memory carries now (tmsdisk_tags)."""
    call = "tmsdisk.tags()"
    fn = _function(call, "tmsdisk_tags")
    size = ctypes.sizeof(_CTagInfo)
    room = 16
    while True:
        buf = (_CTagInfo * room)()
        n = fn(buf, room, size)
        if n < 0:
            raise Error(-n, call)
        if n <= room:
            break
        room = n + 16  # more came meanwhile: ask again with room to spare
    return [
        TagStatus(
            tag=info.tag.decode("utf-8", "replace"),
            policy=_POLICY_NAMES.get(info.policy, str(info.policy)),
            allocations=info.allocations,
            paused_allocations=info.paused_allocations,
            resident_bytes=info.resident_bytes,
            paused_bytes=info.paused_bytes,
        )
        for info in buf[:n]
    ]


def status() -> Status:
    """This process's state and figures (tmsdisk_status), with its memory by tag (tmsdisk_tags).

    Per-tag figures need API version 4; with an older library `tags` is empty.
    """
    s = _c_status()
    try:
        by_tag = tuple(tags())
    except Error as e:
        if e.errno != _errno.ENOSYS:
            raise
        by_tag = ()
    return Status(
        state=_STATES[s.state] if s.state < len(_STATES) else str(s.state),
        connected=bool(s.connected),
        enabled=bool(s.enabled),
        managed_allocations=s.managed_allocations,
        paused_allocations=s.paused_allocations,
        last_error=s.last_error,
        session_id=s.session_id,
        resident_bytes=s.resident_bytes,
        paused_bytes=s.paused_bytes,
        unmanaged_bytes={name: s.unmanaged_bytes[i] for i, name in enumerate(_UNMANAGED)},
        last_pause_bytes=s.last_pause_bytes,
        last_pause_ns=s.last_pause_ns,
        last_resume_bytes=s.last_resume_bytes,
        last_resume_ns=s.last_resume_ns,
        last_message=s.last_message.decode("utf-8", "replace"),
        damaged_allocations=s.damaged_allocations,
        damaged_bytes=s.damaged_bytes,
        tags=by_tag,
    )



# --- the parts -------------------------------------------------------------------------------------
# store is plain ctypes, imported with the package; optim imports torch, so only on first use
# (tmsdisk.optim or `from tmsdisk import optim`), and it stays out of __all__: `from tmsdisk import *`
# must work where torch is absent.
from . import store  # noqa: E402  (it imports Error and _load from above)


def __getattr__(name):
    if name == "optim":
        import importlib  # pylint: disable=import-outside-toplevel

        return importlib.import_module(".optim", __name__)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
