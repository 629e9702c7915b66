"""Optional C++ operators, compiled on the machine that runs them and kept in the environment that uses them.

`make install` (`python -m sobrio.csrc`) builds them once into `<sys.prefix>/share/sobrio/ops/<key>/`
(or `~/.cache/sobrio/ops/<key>/` where sys.prefix is read-only). The key hashes everything that changes
the binary: source and header bytes, compiler flags, torch and Python versions, the CPU's feature flags
(`-march=native`). A start imports the library for its key directly: no lock, no torch extension
folder, nothing to wait on. Where it is missing, the start builds it (about a minute) in a folder of
its own and renames it into place, so an interrupted build leaves only a temporary folder that later
starts ignore. If nothing builds, `load()` returns None and callers keep the PyTorch path.
"""

import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

NAME = "sobrio_cpu_ops"
SOURCE_DIR = Path(__file__).parent
SOURCES = ("bindings.cpp", "paged_attention.cpp", "cpu_ops.cpp", "amx_linear.cpp", "grouped_linear.cpp",
           "vnni_linear.cpp", "blocked_gemv.cpp", "lora.cpp", "prompt_attention.cpp", "sampling.cpp")
HEADERS = ("aten.h", "ops.h", "fused_decode.h", "vec.h", "amx.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
BUILD_PREFIX = ".build-"  # temporary folders; a build killed midway leaves one behind
STALE_AFTER_S = 3600.0  # a temporary folder older than this belongs to no live build
INFO_FILE = "build-info.json"

Builder = Callable[[Path], None]  # compiles f"{NAME}.so" into the given empty folder
_load_lock = threading.Lock()  # threads of one process share one build; dies with the process


def load() -> ModuleType | None:
    """The operators module, or None (disabled, or no compiler): callers then use the PyTorch path."""
    with _load_lock:
        return _load_once()


@functools.cache
def _load_once() -> ModuleType | None:
    """Load (or build) at most once per process: every caller then shares the same module."""
    if os.environ.get("SOBRIO_DISABLE_CPP"):
        return None
    try:
        return load_or_build()
    except Exception as exc:  # no compiler, headers missing, read-only disk: keep the PyTorch path
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        logger.warning("C++ operators unavailable (%s: %s); using the PyTorch path",
                       type(exc).__name__, first_line)
        logger.debug("C++ operators build failure", exc_info=True)
        return None


def load_or_build(roots: Sequence[Path] | None = None, inputs: dict | None = None,
                  builder: Builder | None = None) -> ModuleType:
    """Import the library built for these inputs; build it first (into the first writable root) if absent."""
    import torch  # noqa: F401  the library links against libtorch: its symbols must be loaded first

    roots = list(roots) if roots is not None else ops_roots()
    inputs = inputs if inputs is not None else build_inputs()
    key = key_of(inputs)
    library = find_library(roots, key)
    if library is None:
        library = build(writable_root(roots), key, builder or torch_build, inputs)
    else:
        logger.info("loading C++ operators from %s", library)
    return import_library(library)


def ops_roots() -> list[Path]:
    """Where built operators live: inside this environment first, then the per-user cache."""
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [Path(sys.prefix) / "share" / "sobrio" / "ops", cache_home / "sobrio" / "ops"]


def find_library(roots: Sequence[Path], key: str) -> Path | None:
    """The built library for this key in the first root that has it; a plain stat, nothing locked."""
    for root in roots:
        library = root / key / f"{NAME}.so"
        if library.is_file():
            return library
    return None


def writable_root(roots: Sequence[Path]) -> Path:
    """The first root we can create and write into (sys.prefix may belong to root)."""
    for root in roots:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(root, os.W_OK | os.X_OK):
            return root
    raise PermissionError(f"no writable folder for C++ operators among {[str(r) for r in roots]}")


def build_inputs(source_dir: Path = SOURCE_DIR, cflags: Sequence[str] = CFLAGS,
                 ldflags: Sequence[str] = LDFLAGS) -> dict:
    """Everything that changes the binary; its hash names the build folder."""
    import torch

    files = sorted({*SOURCES, *HEADERS})
    return {
        "sources": {name: hashlib.sha256((source_dir / name).read_bytes()).hexdigest() for name in files},
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "compiler": os.environ.get("CXX", "c++"),  # torch's choice; its version is not hashed
        "torch": torch.__version__,
        "python": f"{sys.implementation.cache_tag}-{platform.machine()}",
        "cpu_flags": cpu_flags(),
    }


def build_key(source_dir: Path = SOURCE_DIR, cflags: Sequence[str] = CFLAGS,
              ldflags: Sequence[str] = LDFLAGS) -> str:
    """The key of this checkout's build: equal keys mean one binary serves both."""
    return key_of(build_inputs(source_dir, cflags, ldflags))


def key_of(inputs: dict) -> str:
    """A short, stable hash of the build inputs: the name of their build folder."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def cpu_flags() -> str:
    """The CPU's feature flags (what `-march=native` compiles for); the processor name off Linux."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.split(":", 1)[0].strip() in ("flags", "Features"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(root: Path, key: str, builder: Builder, inputs: dict) -> Path:
    """Build into a fresh folder of this process's own, then rename it into place; the rename is atomic."""
    remove_stale_builds(root)
    final = root / key
    scratch = Path(tempfile.mkdtemp(prefix=f"{BUILD_PREFIX}{key}-{os.getpid()}-", dir=root))
    logger.info("building C++ operators (about a minute) into %s", final)
    started = time.monotonic()
    try:
        builder(scratch)
        keep_only_library(scratch)
        (scratch / INFO_FILE).write_text(json.dumps(inputs, indent=1, sort_keys=True))
        scratch.chmod(0o755)  # mkdtemp made it private; other users of this environment load it too
        place(scratch, final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone already when our rename won
    logger.info("built in %.0f s", time.monotonic() - started)
    return final / f"{NAME}.so"


def place(scratch: Path, final: Path) -> None:
    """Rename our build to its key's folder; if another process got there first, theirs stands."""
    try:
        os.rename(scratch, final)
        return
    except OSError:
        if (final / f"{NAME}.so").is_file():
            logger.info("another process built the C++ operators first; using %s", final)
            return
    # The folder is there without a library (damaged by hand): set it aside, then take its place.
    aside = Path(tempfile.mkdtemp(prefix=f"{BUILD_PREFIX}broken-", dir=final.parent))
    os.rename(final, aside / final.name)
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(scratch, final)


def keep_only_library(folder: Path) -> None:
    """Drop object files and ninja state: only the library is needed at start."""
    if not (folder / f"{NAME}.so").is_file():
        raise FileNotFoundError(f"the build left no {NAME}.so in {folder}")
    for entry in folder.iterdir():
        if entry.name != f"{NAME}.so":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def remove_stale_builds(root: Path, older_than_s: float = STALE_AFTER_S) -> None:
    """Delete temporary folders left by builds that were killed; younger ones may still be running."""
    cutoff = time.time() - older_than_s
    for entry in root.glob(f"{BUILD_PREFIX}*"):
        try:
            if entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue  # another process removed it first


def torch_build(folder: Path) -> None:
    """Compile with torch's cpp_extension into `folder`; torch's lock lives (and dies) in there."""
    from torch.utils import cpp_extension

    # torch renames a second build in one process to NAME_v1; each of ours is fresh, so keep the name.
    versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
    if versioner is not None:
        versioner.entries.pop(NAME, None)
    # is_python_module=False: torch dlopens the file without initialising it; import_library does that
    # once from the final path (the same inode after the rename, so the same loaded library).
    cpp_extension.load(name=NAME, sources=[str(SOURCE_DIR / name) for name in SOURCES],
                       extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                       extra_include_paths=[str(SOURCE_DIR)], build_directory=str(folder),
                       is_python_module=False, verbose=False)


def import_library(library: Path) -> ModuleType:
    """Import the extension module from its file, as torch would, without touching sys.modules."""
    spec = importlib.util.spec_from_file_location(NAME, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
