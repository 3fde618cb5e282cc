"""The machine line every benchmark report carries."""

from __future__ import annotations

import os
import platform
import time


def describe() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{platform.node()}: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
