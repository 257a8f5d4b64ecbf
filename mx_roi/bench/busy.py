"""``--busy``: another process keeps one core busy while the workloads run again."""
from __future__ import annotations

import subprocess
import sys
import time

__all__ = ["busy_core", "add_busy_ratios"]

#: the competing process: one Python thread spinning (one core's worth of work)
SPINNER = "import time\nwhile True:\n    pass\n"


class busy_core:
    """Context manager: another process keeps one core busy while inside."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", SPINNER],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.2)  # let it get scheduled
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
        return False


def add_busy_ratios(busy_rows, quiet_rows) -> None:
    """Busy rows gain ``ours_busy_over_quiet``, ``builtin_busy_over_quiet``, ``quiet_ratio``."""
    quiet = {(r["key"], r["direction"]): r for r in quiet_rows}
    for r in busy_rows:
        q = quiet.get((r["key"], r["direction"]), {})

        def rel(a, b):
            return a / b if a is not None and b else None
        r.update(ours_busy_over_quiet=rel(r.get("ours_ms"), q.get("ours_ms")),
                 builtin_busy_over_quiet=rel(r.get("builtin_ms"), q.get("builtin_ms")),
                 quiet_ratio=q.get("ratio"))

