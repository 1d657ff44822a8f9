"""What the memory benchmarks measure, in one place: a process's peak
resident memory and the CPU's name (figures hold for that CPU only)."""


def peak_mb():
    """This process's peak resident memory (VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def cpu_model():
    """The CPU's model name (from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f
                        if l.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or "unknown CPU"
