"""Run a script with Triton's compiler rather than its interpreter (the kernel tests' offline sm_90 builds)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_without_interpreter(script: str) -> list[str]:
    """Run `script` in a fresh interpreter without TRITON_INTERPRET; returns its non-empty stdout lines."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    return [line for line in done.stdout.split("\n") if line]
