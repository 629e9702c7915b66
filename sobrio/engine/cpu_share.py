"""Share the CPU politely: the engine core's threads follow the cores that other processes leave free.

An OpenMP team as wide as the machine is right on an idle host and ruinous on a shared one: each parallel
region waits for its slowest thread, and a thread whose core another process holds makes every region
wait a time slice (a one-core busy neighbour on 2 cores cost ~6x). `ThreadGovernor` measures, four times a
second, the CPU that processes other than this engine (the core and its API process) use (`/proc/stat`),
within the cores this process may use (affinity, and a cgroup `cpu.max` quota), and sets torch's intra-op
threads to the cores left (at least 1). `spin_count_for_start` picks the OpenMP spin of a new core process
the same way: the long spin only on a host that looked free. `num_threads` (ParallelConfig), OMP_NUM_THREADS, and
OMP_WAIT_POLICY/GOMP_SPINCOUNT still win: the governor then leaves the threads (or the spin) alone.
"""

import logging
import math
import os
import time

logger = logging.getLogger(__name__)

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
INTERVAL_S = 0.25  # how often the governor looks: between layers (a long prompt step is many looks), and an
# idle core wakes this often too, so a request that comes just as a neighbour stops finds a recent look
# Seconds of looks in a row asking for the same new width before it changes: fewer threads only for a neighbour
# that stays (a benchmark client's or a CLI's start-up, 2-3 s of imports, had halved a 10 s prompt step that
# followed it); more threads at the first look that sees the cores free (a request sent as a neighbour
# stopped ran its first seconds on one thread while the governor waited for more looks: docs/sharing-and-soak.md);
# a long step that saw the cores free or busy counts for its whole length.
LOWER_AFTER_S = 4.0
RAISE_AFTER_S = 0.0
ARRIVAL_LOOK_S = 0.15  # the first look after work comes to an idle core: sooner than INTERVAL_S (a 1,000-token
# prompt's first layers would run on one thread meanwhile), long enough for /proc/stat's 100 Hz ticks to tell a
# busy core from a free one
SLACK = 0.3  # a core counts as free when others leave at least 1 - SLACK of it


def cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """The cgroup's CPU limit in cores (v2 `cpu.max`, or v1's cfs quota), None when unlimited."""
    try:
        with open(f"{root}/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(f"{root}/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open(f"{root}/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def allowed_cores() -> float:
    """The cores this process may use: its affinity, capped by a CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    return min(cores, quota) if quota else float(cores)


def _system_busy_ticks() -> tuple[int, int]:
    """(busy, total) ticks of all CPUs since boot, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    return total - idle, total


def _process_ticks(pid: int) -> int:
    """utime + stime of one process (all its threads), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


class OthersMeter:
    """Cores used by other processes than `ours` since the last reading."""

    def __init__(self, ours: list[int]):
        self.ours = ours
        self._last = self._read()

    def _read(self) -> tuple[float, int, int]:
        busy, _ = _system_busy_ticks()
        return time.monotonic(), busy, sum(_process_ticks(pid) for pid in self.ours)

    def restart(self) -> None:
        """The next reading covers from now on."""
        self._last = self._read()

    def age(self) -> float:
        """Seconds the next reading covers."""
        return time.monotonic() - self._last[0]

    def cores(self) -> float:
        now, busy, ours = self._read()
        then, busy_then, ours_then = self._last
        self._last = (now, busy, ours)
        elapsed = max(now - then, 1e-3)
        return max(0.0, ((busy - busy_then) - (ours - ours_then)) / TICKS / elapsed)


def threads_for(allowed: float, others: float, most: int) -> int:
    """The threads worth running: the allowed cores others leave (at least 1, at most `most`)."""
    return max(1, min(most, math.floor(allowed - others + SLACK)))


class ThreadGovernor:
    """Adjusts torch's intra-op threads to the free cores; `poll` is cheap (a clock read) between looks."""

    def __init__(self, set_threads, most: int, ours: list[int], interval: float = INTERVAL_S):
        self.set_threads, self.most, self.interval = set_threads, most, interval
        self.allowed = allowed_cores()
        self.meter = OthersMeter(ours)
        self.threads = most
        self._last = time.monotonic()
        self._next = self._last + interval
        self._proposal, self._seen_s = most, 0.0
        self.changes = 0

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        span, self._last = now - self._last, now  # the meter's reading covers the same span
        self._next = now + self.interval
        want = threads_for(self.allowed, self.meter.cores(), self.most)
        self._seen_s = self._seen_s + span if want == self._proposal else span
        self._proposal = want
        needed = LOWER_AFTER_S if want < self.threads else RAISE_AFTER_S
        if want != self.threads and self._seen_s >= needed:
            logger.info("CPU shared: %d -> %d engine threads (%.1f cores allowed)", self.threads, want, self.allowed)
            self.threads = want
            self.changes += 1
            self.set_threads(want)

    def work_arrived(self, now: float | None = None) -> None:
        """Work came to an idle core: the next look covers from now on, so it does not read a neighbour's last
        moments before the work came (which would hold the threads down for one more look), and comes after
        ARRIVAL_LOOK_S."""
        now = time.monotonic() if now is None else now
        self.meter.restart()
        self._last, self._next = now, now + min(ARRIVAL_LOOK_S, self.interval)


def open_governor(num_threads_flag: int | None) -> ThreadGovernor | None:
    """A governor for this engine-core process, unless the user fixed the threads (`num_threads` or OMP_NUM_THREADS)."""
    if num_threads_flag is not None or "OMP_NUM_THREADS" in os.environ:
        return None
    import torch

    most = torch.get_num_threads()
    if most <= 1:
        return None
    return ThreadGovernor(torch.set_num_threads, most, [os.getpid(), os.getppid()])


def spin_count_for_start(long_spin: str, short_spin: str, probe_s: float = 0.25) -> str:
    """The OpenMP spin for a new engine-core process: the long one only if nobody else seemed busy (over at
    least `probe_s`) and no quota holds the process below its cores. A process's first start reads the look
    begun when this module was imported (`sobrio serve`'s first tenths of a second), so its spawn does not wait
    the whole probe."""
    quota = cpu_quota()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if quota is not None and quota < cores:
        return short_spin
    meter = _first_look()
    time.sleep(max(0.0, probe_s - meter.age()))
    return long_spin if meter.cores() < 1 - SLACK else short_spin


FIRST_LOOK_MAX_AGE_S = 5.0  # older, it tells little of the host now: a later start (a restarted core) looks anew
_first: list[OthersMeter] = [OthersMeter([os.getpid()])]


def _first_look() -> OthersMeter:
    """The look begun at import for the first start of this process, if recent; a fresh one otherwise."""
    first = _first.pop() if _first else None
    if first is not None and first.age() <= FIRST_LOOK_MAX_AGE_S:
        return first
    return OthersMeter([os.getpid()])
