# SPDX-License-Identifier: Apache-2.0
"""tmsdisk's Python start-up module: PyTorch hands back its cache before a pause, and, when asked,
torch.optim.AdamW and Adam stream their state through tmsdiskd's store.

`tmsctl run` puts this directory first on PYTHONPATH, so Python's `site` imports this file at start-up
in every Python process of the job. When libtmsdisk.so is preloaded and TMSDISK_TORCH_EMPTY_CACHE is
not "0", it registers a tmsdisk_on_pause callback (tmsdisk.h) that calls torch.cuda.empty_cache()
before each pause: blocks that PyTorch's caching allocator holds but no tensor uses are garbage to the
program, and moving them to disk and back is pure waste.

- It never imports torch: a program that does not use torch, or has not initialized CUDA, is left
  alone.
- empty_cache() releases only cached blocks that no tensor uses. It synchronizes the events of blocks
  freed on other streams itself, and the pause synchronizes every context once CUDA calls are held, so
  no torch.cuda.synchronize() is needed. CUDA graphs' private pools stay: the allocator's
  release_cached_blocks walks only graph_pools_freeable, pools whose graphs were all released
  (use_count 0); a live graph's pool is never freed, so replaying it after the resume finds its memory.
- The callback runs on a thread of the shim and takes the GIL (ctypes does, around the call). A thread
  that pauses its own process must release the GIL while it waits: ctypes.CDLL calls do
  (ctypes.CDLL(None).tmsdisk_pause()), ctypes.PyDLL calls do not; with PyDLL the pause goes on without
  emptying the cache once TMSDISK_PAUSE_CALLBACK_TIMEOUT_MS has passed.
- Nothing raised in the callback reaches the shim: it is caught, and told with TMSDISK_LOG=debug.

With TMSDISK_STREAM_OPTIMIZER set (`tmsctl run --stream-optimizer[=fp32|bf16|fp8]`), torch.optim.AdamW
and torch.optim.Adam become tmsdisk.optim's StreamedAdamW and StreamedAdam, keeping their moments in the
dtype named (fp32 by default; fp8 is float8_e4m3fn with per-block scales). torch is not imported for
it: the classes are replaced once the program's own `import torch` has run, before the program sees
torch.optim. A value that cannot be honoured stops the process at start, before any work; fp8 with a
torch that has no float8 (before 2.1) fails the program's `import torch`, saying so.

Python imports only the first `sitecustomize` on its path, so this one then runs the one it hides (a
site's or a virtual environment's own), which stays importable as `sitecustomize`.
"""

import os
import sys


def _debug_enabled():
    return os.environ.get("TMSDISK_LOG", "").strip().lower() == "debug"


def _debug(message):
    if _debug_enabled():
        sys.stderr.write("[tmsdisk %d] debug: python: %s\n" % (os.getpid(), message))


def _empty_torch_cache(_arg):
    try:
        torch = sys.modules.get("torch")  # never imported here: only a program's own torch counts
        cuda = getattr(torch, "cuda", None) if torch is not None else None
        if cuda is None or not cuda.is_initialized():
            _debug("before pause: torch %s; nothing to empty" % ("not loaded" if torch is None else "has no CUDA yet"))
            return
        before = cuda.memory_reserved() if _debug_enabled() else 0
        cuda.empty_cache()
        if _debug_enabled():
            _debug(
                "before pause: torch.cuda.empty_cache() released %d bytes of cache (%d reserved now)"
                % (before - cuda.memory_reserved(), cuda.memory_reserved())
            )
    except BaseException as e:  # pylint: disable=broad-except
        # Raised into ctypes it would be printed as "Exception ignored"; the pause must go on anyway.
        _debug("before pause: emptying torch's cache failed: %r" % (e,))


def _register():
    if os.environ.get("TMSDISK_TORCH_EMPTY_CACHE", "1") == "0":
        return None
    import ctypes

    try:
        on_pause = ctypes.CDLL(None).tmsdisk_on_pause  # present only where libtmsdisk.so is loaded
    except (AttributeError, OSError):
        return None
    on_pause.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_pause.restype = ctypes.c_int
    # The shim keeps the C pointer for the life of the process: this object must live as long (a
    # module global of a module that stays in sys.modules).
    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_empty_torch_cache)
    rc = on_pause(ctypes.cast(callback, ctypes.c_void_p), None)
    if rc != 0:
        _debug("tmsdisk_on_pause failed: %s" % os.strerror(-rc))
        return None
    _debug("torch's cache is emptied before each pause")
    return callback


# TMSDISK_STREAM_OPTIMIZER's values: the moments' torch dtype by name (tmsdisk.optim keeps fp8 ones in
# blocks with a scale each).
_STREAM_MOMENTS = {"fp32": "float32", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}


def _stream_optimizer_setting():
    """The value of TMSDISK_STREAM_OPTIMIZER when streaming is asked for (None when unset or empty). A
    value that cannot be honoured ends the process: a job asked to stream must not run without."""
    value = os.environ.get("TMSDISK_STREAM_OPTIMIZER", "").strip().lower()
    if not value:
        return None
    if value in _STREAM_MOMENTS:
        return value
    os.write(2, ("[tmsdisk %d] error: python: TMSDISK_STREAM_OPTIMIZER=%s (what `tmsctl run --stream-optimizer=%s` "
                 "sets): not one of fp32, bf16, fp8; use one of them, or leave it unset\n" % (
                     os.getpid(), value, value)).encode())
    # site.py would turn SystemExit into a fatal "Failed to import the site module" with a traceback.
    os._exit(2)


def _stream_bucket_elements():
    """TMSDISK_STREAM_BUCKET_ELEMENTS: the streamed classes' default bucket_elements (None: theirs, 200 M).
    A value that is not a plain positive integer is refused with a message, and their default is used."""
    value = os.environ.get("TMSDISK_STREAM_BUCKET_ELEMENTS", "").strip()
    if not value:
        return None
    if value.isdigit() and int(value) > 0:
        return int(value)
    os.write(2, ("[tmsdisk %d] warn: python: TMSDISK_STREAM_BUCKET_ELEMENTS=%s is not a plain positive integer; "
                 "buckets of the default size\n" % (os.getpid(), value)).encode())
    return None


def _stream_torch_optimizers(torch, setting):
    """torch.optim.AdamW and Adam become the streamed classes.

    Only torch.optim's names: torch's own modules keep theirs (torch.optim.adamw.AdamW), which their code
    looks up (torch 1.13's AdamW.__init__ calls super(AdamW, self), and the streamed class builds a torch
    AdamW to learn its defaults)."""
    import functools

    from tmsdisk import optim  # imports torch, which has finished its own import by now

    moment_dtype = getattr(torch, _STREAM_MOMENTS[setting], None)
    if moment_dtype is None:  # fp8 before torch 2.1; raised into the program's `import torch`
        raise RuntimeError("this torch (%s) has no torch.%s; %s moments need PyTorch 2.1 or later" % (
            getattr(torch, "__version__", "?"), _STREAM_MOMENTS[setting], setting))
    defaults = {}
    if moment_dtype != torch.float32:
        defaults["moment_dtype"] = moment_dtype
    bucket_elements = _stream_bucket_elements()
    if bucket_elements:
        defaults["bucket_elements"] = bucket_elements
    for original, streamed in ((torch.optim.AdamW, optim.StreamedAdamW), (torch.optim.Adam, optim.StreamedAdam)):
        if defaults:
            # The class as the program's code names it, with these defaults; an explicit argument still wins.
            streamed = type(streamed.__name__, (streamed,), {
                "__init__": functools.partialmethod(streamed.__init__, **defaults),
                "__module__": streamed.__module__, "__doc__": streamed.__doc__, "__qualname__": streamed.__qualname__})
        setattr(torch.optim, original.__name__, streamed)
    _debug("torch.optim.AdamW and Adam stream their state (%s moments)" % setting)


class _AfterTorchImport:
    """A meta path finder that finds nothing itself: when `torch` is imported, it has the rest of the path
    find it and runs _stream_torch_optimizers once torch's own module has run (a post-import hook)."""

    def __init__(self, setting):
        self.setting = setting

    def find_spec(self, fullname, path, target=None):  # pylint: disable=unused-argument
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # once, and out of the way of the search below
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, self.setting)
        return spec


class _PatchingLoader:
    def __init__(self, loader, setting):
        self.loader, self.setting = loader, setting

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader  # torch keeps its own loader, as if this one had never been there
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        try:
            _stream_torch_optimizers(module, self.setting)
        except Exception as e:
            raise ImportError("TMSDISK_STREAM_OPTIMIZER=%s (tmsctl run --stream-optimizer): torch.optim's AdamW and "
                              "Adam could not be replaced by tmsdisk.optim's: %s: %s" % (
                                  self.setting, type(e).__name__, e)) from e


def _stream_optimizer():
    setting = _stream_optimizer_setting()
    if setting is None:
        return
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "optim"):  # imported before this module ran (embedded Python)
        _stream_torch_optimizers(torch, setting)
    else:
        sys.meta_path.insert(0, _AfterTorchImport(setting))


def _run_hidden_sitecustomize():
    """Imports the next `sitecustomize` on sys.path after this directory, as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    if spec.origin and os.path.realpath(spec.origin) == os.path.realpath(__file__):
        return  # this very file again, under another name
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception:  # pylint: disable=broad-except
        # As site.py treats a failing sitecustomize: say so, and start the program anyway.
        import traceback

        sys.stderr.write("Error in sitecustomize (%s); set PYTHONVERBOSE for traceback:\n" % spec.origin)
        traceback.print_exc()


# This module leaves sys.modules["sitecustomize"] to the one it hides; it stays alive under its own
# name, since it holds the callback the shim calls.
sys.modules["_tmsdisk_sitecustomize"] = sys.modules[__name__]
try:
    _CALLBACK = _register()
except Exception as _e:  # pylint: disable=broad-except
    _CALLBACK = None
    _debug("not registered: %r" % (_e,))
_stream_optimizer()
_run_hidden_sitecustomize()
