"""The native CPU selection kernel (``topk.cpp``): built once with the system C++ compiler,
loaded with ctypes.

The kernel has a plain C ABI and no torch headers, so it builds in about a second and works
with whatever torch is installed. ``docker/install.sh`` builds it (``python -m hvd_topk.native``);
if it is missing at import time it is built then, into a per-user cache keyed by the source's
hash (``HVD_TOPK_NATIVE_DIR`` overrides the place). Without a compiler hvd_topk still works:
selection falls back to torch ops, with one warning saying so and how to fix it.
"""

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("topk.cpp")
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno"]
ABI_VERSION = 12

_lock = threading.Lock()
_lib = None
_error = None


def _library_path():
    # the machine too: a home directory shared by x86 and aarch64 nodes holds one of each
    key = SOURCE.read_bytes() + " ".join(FLAGS).encode() + platform.machine().encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    root = os.environ.get("HVD_TOPK_NATIVE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvd_topk", "native")
    return Path(root) / f"libhvdtk-{digest}.so"


def build(verbose=False):
    """Compile the kernel if its cached library is missing; return the library's path."""
    path = _library_path()
    if path.exists():
        return path
    compiler = shlex.split(os.environ.get("CXX", "")) or [shutil.which("g++") or shutil.which("c++")]
    if not compiler[0]:
        raise RuntimeError("no C++ compiler found (install g++, or set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build to a temporary name and rename: ranks starting together may build at once.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [*compiler, *FLAGS, "-o", tmp, str(SOURCE)]
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        try:
            result = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:  # the compiler could not be started
            raise RuntimeError(f"running {compiler[0]} failed: {exc}") from None
        if result.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{result.stderr[-4000:]}")
        # mkstemp made it 0600: readable by every user of a shared HVD_TOPK_NATIVE_DIR, as a
        # compiler's own output would be
        os.chmod(tmp, 0o755 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _umask():
    """The process's umask, read without changing it (os.umask sets it to read it, which races
    with other threads creating files); that way where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _load():
    """The built library, loaded and declared; a cached file that does not load (truncated,
    replaced, another ABI) is removed and built again, once. The rebuilt one is loaded under a
    name of its own: dlopen hands back a library it already loaded by its path."""
    path = build()
    try:
        return _declare(ctypes.CDLL(str(path)))
    except (OSError, AttributeError, RuntimeError):
        path.unlink(missing_ok=True)
    fresh = build()
    fd, alias = tempfile.mkstemp(suffix=".so", dir=fresh.parent)
    os.close(fd)
    try:
        shutil.copyfile(fresh, alias)
        return _declare(ctypes.CDLL(alias))
    finally:
        os.unlink(alias)  # (the mapping stays)


def _declare(lib):
    p, i64, i32, u64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64, ctypes.c_double
    scatter = [p, p, i64, p, i32, p, i64, i64, i64, f64, f64]
    signatures = {  # every entry point returns int64
        "hvdtk_select_f32": [p, p, i64, i64, i64, p, i32, p, i32, i32, u64, p],
        "hvdtk_select_segments_f32": [p, i64, p, p, p, i32, p, i32, i32, u64, p, p],
        "hvdtk_scatter_segments_f32": scatter,
        "hvdtk_scatter_segments_f16_f32": scatter,
        "hvdtk_take_f32": [p, i64, p, i32, i64, p, i32],
        "hvdtk_fold_f32": [p, p, i64],
        "hvdtk_compact_pack_f32": [p, p, i32, i64, p, i64, i32, p, p, i64, i64, p, i64, p, p, i32],
        "hvdtk_compact_unpack_f32": [p, i64, i64, i64, i64, i64, i64, i64, i64, p, i64, i32, p, p, i32, i64, i32],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, i64
    lib.hvdtk_abi_version.restype = i32
    if lib.hvdtk_abi_version() != ABI_VERSION:
        raise RuntimeError("stale native library: ABI version mismatch")
    return lib


def library():
    """The loaded kernel, or None (with one warning) when it cannot be built or loaded."""
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    with _lock:
        if _lib is None and _error is None:
            if os.environ.get("HVD_TOPK_NATIVE", "1") == "0":
                _error = "disabled by HVD_TOPK_NATIVE=0"
                return None
            try:
                _lib = _load()
            except Exception as exc:  # noqa: BLE001 - any failure means: use torch ops
                _error = str(exc)
                warnings.warn(f"hvd_topk: the native CPU selection kernel is unavailable ({exc}); "
                              "using torch ops, which are several times slower. Run "
                              "`python -m hvd_topk.native` to see the build error.")
    return _lib


def unavailable_reason():
    library()
    return _error
