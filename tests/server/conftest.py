"""Real `sobrio serve` processes on 127.0.0.1, a free port each, logs captured to a file."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SMALL = ("--model", "smollm2-135m", "--kv-cache-memory", str(64 << 20), "--max-model-len", "512")


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll `check` until it holds or `timeout` seconds pass; the last answer."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


class ServerProcess:
    def __init__(self, *args: str, timeout: float = 240.0):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "sobrio.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            self._wait_healthy(timeout)
        except BaseException:  # never leave a half-started server (or its log) behind
            self.stop()
            os.unlink(self.log.name)
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited early:\n{self.log_text()[-3000:]}"
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise TimeoutError(f"server did not start:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def metric(self, name: str, model: str) -> float:
        text = httpx.get(f"{self.base_url}/metrics").text
        for line in text.splitlines():
            if line.startswith(f"sobrio:{name}{{") and f'model_name="{model}"' in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then SIGKILL past `timeout`; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@contextmanager
def serving(*args: str) -> Iterator[ServerProcess]:
    """A server for a `with` block or a fixture: stopped and its log removed however the block ends."""
    srv = ServerProcess(*args)
    try:
        yield srv
    finally:
        srv.stop()
        os.unlink(srv.log.name)


@pytest.fixture(scope="session")
def server():
    """Both default models, float32 (to compare with the offline engine), debug logs."""
    with serving("--dtype", "float32", "--kv-cache-memory", str(256 << 20), "--max-model-len", "1024",
                 "--log-level", "debug") as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer, the model SMALL serves (to count and decode tokens beside the server)."""
    from sobrio.loader.load import load_model_files

    return load_model_files(SMALL[1]).tokenizer
