"""The engine core's threads follow the cores other processes leave free (issue 40); the user's choice wins."""

import os
import subprocess
import sys
import time

import pytest

from sobrio.engine import cpu_share
from sobrio.engine.cpu_share import OthersMeter, ThreadGovernor, cpu_quota, open_governor, threads_for


def test_threads_are_the_free_cores_at_least_one():
    assert threads_for(2.0, 0.1, 2) == 2
    assert threads_for(2.0, 1.0, 2) == 1  # a one-core neighbour on 2 cores
    assert threads_for(2.0, 3.5, 2) == 1
    assert threads_for(8.0, 2.6, 8) == 5
    assert threads_for(1.5, 0.0, 4) == 1  # a quota of 1.5 cores: one thread (spin fights the throttle)


def test_cgroup_quotas_v2_and_v1(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cpu_quota(str(tmp_path)) == 0.5
    assert cpu_quota(str(tmp_path / "nowhere")) is None


class FakeMeter:
    def __init__(self, readings):
        self.readings = list(readings)
        self.restarts = 0

    def restart(self) -> None:
        self.restarts += 1

    def cores(self) -> float:
        return self.readings.pop(0)


def test_the_governor_lowers_for_a_neighbour_that_stays_and_raises_at_the_first_free_look(monkeypatch):
    monkeypatch.setattr(cpu_share, "allowed_cores", lambda: 2.0)
    widths = []
    gov = ThreadGovernor(widths.append, most=2, ours=[os.getpid()], interval=cpu_share.INTERVAL_S)
    clock = gov._last

    def looks(*spans_and_others):
        nonlocal clock
        gov.meter = FakeMeter([others for _, others in spans_and_others])
        for span, _ in spans_and_others:
            clock += span
            gov.poll(clock)

    looks((1, 1.0), (1, 1.0), (1, 1.0), (1, 0.0))  # a client's 3 s start-up burst: not a neighbour
    assert widths == []
    looks((1, 1.0), (1, 1.0), (1, 1.1), (1, 1.0))  # busy 4 s in a row: one core left to us
    assert widths == [1]
    looks((0.1, 0.0))  # sooner than the next look: nothing read
    assert widths == [1]
    looks((0.15, 0.8))  # a look over the neighbour's last moments (a request arrived as it stopped)
    assert widths == [1]
    looks((0.25, 0.1))  # the next look sees the core free: both threads at once
    assert widths == [1, 2]
    looks((1, 1.0), (1, 1.0), (1, 1.0), (10, 1.0))  # a long step beside a busy neighbour counts its whole length
    assert widths == [1, 2, 1]
    looks((0.25, 0.9), (0.25, 1.0))  # a neighbour still busy keeps us at one
    assert widths == [1, 2, 1]
    looks((10, 0.0))  # and a long step that saw the other core free raises
    assert widths == [1, 2, 1, 2] and gov.threads == 2 and gov.changes == 4


def test_work_that_arrives_starts_a_fresh_look(monkeypatch):
    """The look after a request came covers only the time since, not the neighbour's last moments before it."""
    monkeypatch.setattr(cpu_share, "allowed_cores", lambda: 2.0)
    widths = []
    gov = ThreadGovernor(widths.append, most=2, ours=[os.getpid()], interval=cpu_share.INTERVAL_S)
    gov.meter = FakeMeter([1.0] * 5 + [0.0])
    clock = gov._last
    for _ in range(5):  # a neighbour busy for 5 s while the core idles: one thread
        clock += 1
        gov.poll(clock)
    assert widths == [1]
    clock += 0.2  # the neighbour stops; a request comes 0.2 s after the last look, which it would have read
    gov.work_arrived(clock)
    assert gov.meter.restarts == 1
    gov.poll(clock + cpu_share.ARRIVAL_LOOK_S / 2)  # no look yet
    assert widths == [1]
    gov.poll(clock + cpu_share.ARRIVAL_LOOK_S)  # the fresh look, sooner than an interval, reads the core free
    assert widths == [1, 2] and cpu_share.ARRIVAL_LOOK_S < cpu_share.INTERVAL_S


def test_an_idle_core_looks_as_often_as_the_governor():
    """A request that arrives as a neighbour stops must find a look at most one interval old."""
    from sobrio.engine import core_process

    assert core_process.IDLE_POLL_MS / 1000 <= cpu_share.INTERVAL_S


def test_the_meter_sees_a_busy_neighbour_and_not_ourselves():
    ours, everyone = OthersMeter([os.getpid()]), OthersMeter([])
    end = time.process_time() + 0.5
    while time.process_time() < end:  # our own work: counted by a meter that does not know us, not by ours
        pass
    assert everyone.cores() - ours.cores() >= 0.2  # 0.5 s of our CPU over the wall time it took
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 5\n"
                             "while time.monotonic() < end: pass"])
    try:
        time.sleep(1.0)
        ours.cores()
        time.sleep(1.0)
        assert ours.cores() >= 0.6  # others: at least the neighbour's core
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.parametrize("flag, env", [(2, {}), (None, {"OMP_NUM_THREADS": "2"})])
def test_the_users_threads_win(monkeypatch, flag, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert open_governor(flag) is None


def test_the_governor_looks_between_the_layers_of_a_step(tmp_path):
    """A prompt step of many seconds follows a neighbour that comes or goes while it runs: the governor's poll
    runs after every decoder layer, not only between steps."""
    from sobrio import LLM, SamplingParams
    from tests.conftest import engine_kwargs
    from tests.model.tiny_checkpoints import BASE, write_checkpoint

    folder = write_checkpoint(tmp_path / "tiny", "llama", {})
    llm = LLM(str(folder), **engine_kwargs(dtype="float32", max_model_len=256))
    looks = []
    llm.engine.runner.poll_between_layers(lambda: looks.append(1))
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(looks) >= BASE["num_hidden_layers"]  # the prompt's step, layer by layer (decode may be fused)


def test_a_first_start_reads_the_look_begun_at_import_and_later_ones_look_anew(monkeypatch):
    """`sobrio serve`'s first core spawns without waiting the whole probe (the look began at import); a later
    start, or one after the first look has aged, probes afresh."""
    sleeps = []
    monkeypatch.setattr(cpu_share.time, "sleep", sleeps.append)
    monkeypatch.setattr(cpu_share, "cpu_quota", lambda: None)
    early = OthersMeter([os.getpid()])
    early._last = (early._last[0] - 1.0, *early._last[1:])  # begun a second ago
    monkeypatch.setattr(cpu_share, "_first", [early])
    cpu_share.spin_count_for_start("long", "short", probe_s=0.25)
    assert sleeps == [0.0]
    cpu_share.spin_count_for_start("long", "short", probe_s=0.25)  # the first look is spent: a fresh probe
    assert sleeps[1] == pytest.approx(0.25, abs=0.05)
    stale = OthersMeter([os.getpid()])
    stale._last = (stale._last[0] - cpu_share.FIRST_LOOK_MAX_AGE_S - 1, *stale._last[1:])
    monkeypatch.setattr(cpu_share, "_first", [stale])
    cpu_share.spin_count_for_start("long", "short", probe_s=0.25)
    assert sleeps[2] == pytest.approx(0.25, abs=0.05)
