"""An engine-core process dies with its API process, also while it is still loading its weights."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The core process's real entry point, with a load that never ends (a model still loading its weights)
CORE = """
import sys, time
from sobrio.engine import core_process
core_process._start_core = lambda config: time.sleep(600)
core_process.run_engine_core(None, f"ipc://{sys.argv[1]}/in", f"ipc://{sys.argv[1]}/out", 20,
                             parent_pid=int(sys.argv[2]))
"""
# The API process: starts the core, says its pid, waits to be killed
PARENT = """
import os, subprocess, sys, time
core = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())])
print(core.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and line.split()[1] in ("Z", "X") for line in f)
    except FileNotFoundError:
        return True


def test_loading_core_exits_when_its_parent_is_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    folder = tmp_path / "sock"
    folder.mkdir()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CORE, str(folder)], stdout=subprocess.PIPE,
                              env=env, text=True)
    core = None
    try:
        core = int(parent.stdout.readline())
        time.sleep(1.0)  # the core is importing or in its (endless) load: it must exit either way
        assert not _gone(core)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 15
        while not _gone(core) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(core), "the engine core outlived its API process"
        assert not folder.exists(), "the orphan did not remove its socket folder"
    finally:
        parent.kill()
        if core is not None and not _gone(core):
            os.kill(core, signal.SIGKILL)
