"""How a process that torchrun started ends: `run_worker`, called by the `__main__` blocks of the modules
torchrun runs here (`python -m dscale_runtime.distributed`, `python -m trace_collection.collect`, which is what
`dscale-collect --num-workers N` launches), never by library code: it ends the process.

A worker of a gloo group (torch 2.13, CPU) that had destroyed its group still aborted in the interpreter's
teardown about one exit in ten ("terminate called without an active exception", SIGABRT), after an error and
after a clean run alike. torchrun then reported a signal instead of the worker's exit code and stopped its
peers (SIGTERM), sometimes before they had printed their own error. A launched worker therefore ends with
`os._exit` once its job has returned or raised and its output is flushed: it has nothing else to finish
(shards, manifests and outputs are written atomically or flushed before), and its exit code is its job's.
"""

from __future__ import annotations

import os
import sys
import traceback


def launched_group() -> bool:
    """True in a process of a launch of more than one worker (torchrun's WORLD_SIZE > 1)."""
    return os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1")


def run_worker(job, *args) -> None:
    """Run `job(*args)`; in a launched worker of a group, then end the process at once with the job's exit code
    (0, SystemExit's code, or 1 after printing the traceback of any other exception). Elsewhere a plain call."""
    if not launched_group():
        job(*args)
        return
    code = 0
    try:
        job(*args)
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:  # NOTE: what the interpreter does with SystemExit("message")
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported here, then the process ends with exit code 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
