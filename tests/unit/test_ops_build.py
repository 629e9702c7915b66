"""The C++ operators load at start without a lock and build without one that can outlive a process.

A real build takes a minute, so most tests use a fake builder: it drops a tiny compiled extension module
(named like the real one) into the build folder, which exercises the same folders, renames and import.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest

import sobrio.csrc as csrc

FAKE_SOURCE = r"""
#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "sobrio_cpu_ops", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_sobrio_cpu_ops(void) {
    PyObject *module = PyModule_Create(&def);
    if (module != NULL) PyModule_AddIntConstant(module, "fake", 1);
    return module;
}
"""
INPUTS = {"test": "fake operators"}


@pytest.fixture(scope="module")
def fake_library(tmp_path_factory) -> Path:
    """A real (tiny) extension module called sobrio_cpu_ops: compiles in well under a second."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("fake_ops")
    (folder / "fake.c").write_text(FAKE_SOURCE)
    subprocess.run([compiler, "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "fake.c",
                    "-o", "fake.so"], cwd=folder, check=True)
    return folder / "fake.so"


def fake_builder(library: Path, delay_s: float = 0.0, calls: list | None = None):
    """A builder that 'compiles' by copying the fake library (after a delay, to widen races)."""
    def build(folder: Path) -> None:
        if calls is not None:
            calls.append(folder)
        time.sleep(delay_s)
        (folder / "lock").write_text("")  # torch's lock: must never reach the final folder
        (folder / "obj.o").write_text("")
        shutil.copyfile(library, folder / f"{csrc.NAME}.so")
        (folder / "lock").unlink()
    return build


def refuse_to_build(folder: Path) -> None:
    raise AssertionError("a start with a built library must not build")


@pytest.fixture
def fresh_load():
    """load() caches per process: clear it around tests that call it, so other tests see the real one."""
    csrc._load_once.cache_clear()
    yield csrc.load
    csrc._load_once.cache_clear()


def test_loading_a_built_library_takes_no_lock(tmp_path, fake_library, monkeypatch, caplog):
    root = tmp_path / "ops"
    csrc.load_or_build([root], INPUTS, fake_builder(fake_library))
    torch_dir = tmp_path / "torch_extensions"
    torch_dir.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(torch_dir))
    with caplog.at_level("INFO", logger="sobrio.csrc"):
        module = csrc.load_or_build([root], INPUTS, refuse_to_build)
    assert module.fake == 1
    assert Path(module.__file__) == root / csrc.key_of(INPUTS) / f"{csrc.NAME}.so"
    assert "loading C++ operators from" in caplog.text
    assert list(torch_dir.iterdir()) == []
    assert not list(root.rglob("lock"))


def test_build_logs_and_keeps_only_the_library(tmp_path, fake_library, caplog):
    root = tmp_path / "ops"
    with caplog.at_level("INFO", logger="sobrio.csrc"):
        module = csrc.load_or_build([root], INPUTS, fake_builder(fake_library))
    assert module.fake == 1
    assert "building C++ operators (about a minute) into" in caplog.text and "built in" in caplog.text
    assert {p.name for p in root.iterdir()} == {csrc.key_of(INPUTS)}
    assert {p.name for p in (root / csrc.key_of(INPUTS)).iterdir()} == {csrc.NAME + ".so", csrc.INFO_FILE}


def test_racing_builds_end_with_one_library_and_no_lock(tmp_path, fake_library, caplog):
    root = tmp_path / "ops"
    calls: list[Path] = []
    barrier = threading.Barrier(2)
    modules, errors = [], []

    def start() -> None:
        barrier.wait()
        try:
            modules.append(csrc.load_or_build([root], INPUTS, fake_builder(fake_library, 0.3, calls)))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    with caplog.at_level("INFO", logger="sobrio.csrc"):
        threads = [threading.Thread(target=start) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert errors == [] and len(modules) == 2 and len(calls) == 2  # both really built
    assert all(module.fake == 1 for module in modules)
    assert {p.name for p in root.iterdir()} == {csrc.key_of(INPUTS)}  # no scratch folder left
    assert not list(root.rglob("lock"))
    assert "another process built the C++ operators first" in caplog.text


def test_racing_processes_end_with_one_library(tmp_path, fake_library):
    root = tmp_path / "ops"
    script = ("import sys, time, shutil; from pathlib import Path; import sobrio.csrc as c\n"
              "def build(folder):\n"
              "    time.sleep(0.5); shutil.copyfile(sys.argv[2], folder / (c.NAME + '.so'))\n"
              "print(c.load_or_build([Path(sys.argv[1])], {'test': 'race'}, build).fake)\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(root), str(fake_library)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0] and outputs == ["1", "1"]
    assert {p.name for p in root.iterdir()} == {csrc.key_of({"test": "race"})}
    assert not list(root.rglob("lock"))


def test_interrupted_build_neither_blocks_nor_slows_a_start(tmp_path, fake_library):
    root = tmp_path / "ops"
    key = csrc.key_of(INPUTS)
    old = root / f"{csrc.BUILD_PREFIX}{key}-12345-dead"  # killed an hour ago, torch's lock inside
    young = root / f"{csrc.BUILD_PREFIX}{key}-12346-live"  # killed just now (or still running elsewhere)
    for folder in (old, young):
        folder.mkdir(parents=True)
        (folder / "lock").write_text("")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    started = time.monotonic()
    module = csrc.load_or_build([root], INPUTS, fake_builder(fake_library))
    assert module.fake == 1 and time.monotonic() - started < 5
    assert not old.exists() and young.exists()  # only folders that no live build could own go


def test_a_damaged_build_folder_is_replaced(tmp_path, fake_library):
    root = tmp_path / "ops"
    (root / csrc.key_of(INPUTS)).mkdir(parents=True)  # a folder without its library
    module = csrc.load_or_build([root], INPUTS, fake_builder(fake_library))
    assert module.fake == 1
    assert {p.name for p in root.iterdir()} == {csrc.key_of(INPUTS)}


def test_falls_back_to_the_user_cache_when_the_environment_is_read_only(tmp_path, fake_library):
    (tmp_path / "prefix").write_text("")  # a file: nothing can be created below it
    read_only, user_cache = tmp_path / "prefix" / "ops", tmp_path / "cache" / "ops"
    module = csrc.load_or_build([read_only, user_cache], INPUTS, fake_builder(fake_library))
    assert Path(module.__file__).is_relative_to(user_cache)


def test_key_follows_sources_and_flags(tmp_path):
    copy = tmp_path / "csrc"
    copy.mkdir()
    for name in (*csrc.SOURCES, *csrc.HEADERS):
        shutil.copyfile(csrc.SOURCE_DIR / name, copy / name)
    key = csrc.build_key()
    assert csrc.build_key(copy) == key  # the checkout's path is not part of it
    for name in (*csrc.SOURCES, *csrc.HEADERS):
        original = (copy / name).read_bytes()
        (copy / name).write_bytes(original + b" ")
        assert csrc.build_key(copy) != key, name
        (copy / name).write_bytes(original)
    assert csrc.build_key(cflags=[*csrc.CFLAGS, "-DSOMETHING"]) != key
    assert csrc.build_key(cflags=[f for f in csrc.CFLAGS if f != "-march=native"]) != key
    assert csrc.build_key(ldflags=[]) != key
    inputs = csrc.build_inputs()
    assert inputs["cpu_flags"] and inputs["torch"]


def test_failed_build_warns_and_returns_none(tmp_path, monkeypatch, fresh_load, caplog):
    def broken(folder: Path) -> None:
        raise RuntimeError("Error building extension 'sobrio_cpu_ops'\nlong compiler output")

    monkeypatch.setattr(csrc, "ops_roots", lambda: [tmp_path / "ops"])
    monkeypatch.setattr(csrc, "torch_build", broken)
    monkeypatch.delenv("SOBRIO_DISABLE_CPP", raising=False)
    with caplog.at_level("INFO", logger="sobrio.csrc"):
        assert fresh_load() is None
    assert "C++ operators unavailable (RuntimeError: Error building extension" in caplog.text
    assert {p.name for p in (tmp_path / "ops").iterdir()} == set()  # its scratch folder is gone


def test_threads_of_one_process_share_one_build(tmp_path, fake_library, monkeypatch, fresh_load):
    calls: list[Path] = []
    monkeypatch.setattr(csrc, "ops_roots", lambda: [tmp_path / "ops"])
    monkeypatch.setattr(csrc, "torch_build", fake_builder(fake_library, 0.3, calls))
    monkeypatch.delenv("SOBRIO_DISABLE_CPP", raising=False)
    modules: list = []
    threads = [threading.Thread(target=lambda: modules.append(fresh_load())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(calls) == 1 and len(modules) == 3 and all(m is modules[0] and m.fake == 1 for m in modules)


def test_disable_env_skips_everything(monkeypatch, fresh_load):
    monkeypatch.setenv("SOBRIO_DISABLE_CPP", "1")
    monkeypatch.setattr(csrc, "load_or_build", refuse_to_build)
    assert fresh_load() is None


def test_real_operators_load_without_torch_extension_folder(tmp_path):
    """End to end, where `python -m sobrio.csrc` has built them: a stale torch lock does not matter."""
    if csrc.find_library(csrc.ops_roots(), csrc.build_key()) is None:
        pytest.skip("C++ operators not built for this checkout (run `python -m sobrio.csrc`)")
    torch_dir = tmp_path / "torch_extensions"
    (torch_dir / "sobrio_cpu_ops").mkdir(parents=True)
    (torch_dir / "sobrio_cpu_ops" / "lock").write_text("")  # left by an interrupted torch build
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(torch_dir)}
    env.pop("SOBRIO_DISABLE_CPP", None)
    code = "import sobrio.csrc as c; m = c.load(); print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert Path(out).is_relative_to(csrc.ops_roots()[0]) or Path(out).is_relative_to(csrc.ops_roots()[1])
    assert [p.name for p in torch_dir.rglob("*")] == ["sobrio_cpu_ops", "lock"]


def test_the_real_operators_build_on_this_cpu():
    """Where a C++ compiler is, the operators must have built for this CPU: a source that fails to compile on
    one CPU (say a name kept under an AMX guard but used outside it, which broke the build on AMD hosts
    once) would otherwise leave the whole suite green on the slower PyTorch path."""
    if os.environ.get("SOBRIO_DISABLE_CPP"):
        pytest.skip("SOBRIO_DISABLE_CPP is set")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    try:
        module = csrc.load_or_build()
    except Exception as exc:  # the build's own message, whole: it names the file and line
        pytest.fail(f"the C++ operators did not build: {exc}")
    assert hasattr(module, "amx_int8_linear") and hasattr(module, "amx_supported")


# -march targets standing for the CPU classes the sources' guards tell apart, other than the one the suite runs
# on (whose build the test above checks): a name kept under one guard and used outside it compiles here and
# breaks the build there, which happened twice on AMD Zen 4 (the AMX host's suite stayed green). Each comes with
# the guard that sets it apart from an AMX host, so only the kernel files testing it (or including a header that
# does) are compiled; None: every kernel file.
OTHER_CPUS = [
    pytest.param("cooperlake", "__AMX", id="cooperlake"),  # AVX512-BF16 and VNNI, no AMX: AMD Zen 4's guards
    pytest.param("icelake-server", None, id="icelake-server", marks=pytest.mark.exhaustive),  # no AVX512-BF16
    pytest.param("x86-64-v3", None, id="x86-64-v3", marks=pytest.mark.exhaustive),  # AVX2 alone: AMD Zen 2, 3
]


def _tests_guard(source: str, guard: str) -> bool:
    """Whether `source` (or a local header it includes) tests a macro starting with `guard`."""
    text = (csrc.SOURCE_DIR / source).read_text()
    headers = [h for h in csrc.HEADERS if f'#include "{h}"' in text]
    return any(guard in (csrc.SOURCE_DIR / name).read_text() for name in [source, *headers])


@pytest.mark.parametrize("march, guard", OTHER_CPUS)
def test_the_kernels_compile_for_other_cpus(tmp_path, march, guard):
    """The kernel files through the compiler's front end (no code generated) for another CPU class, with the
    build's flags otherwise; with several files, `ops.h` (every kernel file includes it first) precompiled once."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    from torch.utils import cpp_extension

    for source in [*csrc.SOURCES, *csrc.HEADERS]:
        shutil.copyfile(csrc.SOURCE_DIR / source, tmp_path / source)
    flags = ["-std=c++20", "-fPIC", f"-march={march}", "-DTORCH_EXTENSION_NAME=sobrio_cpu_ops",
             *(flag for flag in csrc.CFLAGS if not flag.startswith(("-march", "-O"))),
             *(f"-I{path}" for path in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}"]
    # bindings.cpp: pybind11 and the declarations, nothing that depends on the CPU
    sources = [s for s in csrc.SOURCES if s != "bindings.cpp" and (guard is None or _tests_guard(s, guard))]
    assert sources, f"no kernel file tests {guard}: the parameter is stale"
    if len(sources) > 2:
        subprocess.run([compiler, *flags, "-x", "c++-header", "ops.h", "-o", "ops.h.gch"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, check=True)
    failures = {}
    for source in sources:
        out = subprocess.run([compiler, *flags, "-fsyntax-only", source], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
        if out.returncode:
            failures[source] = [line for line in out.stderr.splitlines() if "error" in line][:3]
    assert not failures, failures
