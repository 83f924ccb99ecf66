"""This process's memory as Linux reports it: the figures the planner's constants, the preflight
and the benchmarks measure against."""

from __future__ import annotations

import resource


def proc_status_bytes(key: str) -> int | None:
    """A memory line of /proc/self/status (VmRSS, VmHWM, RssAnon, ...) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started (VmHWM on Linux).

    Not ru_maxrss: Linux carries the parent's high-water mark into a child across exec (Python's
    subprocess uses vfork), so a run launched from a large process would report the parent's peak.
    """
    hwm = proc_status_bytes("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
