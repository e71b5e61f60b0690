"""``finetune/run.py`` whose rank raises ``RuntimeError("injected failure")`` when it gets ``SIGALRM`` (a signal the
toolkit leaves alone): a rank failing with an exception in the middle of a run, on demand, for
``tests/test_launchers.py::test_dead_rank_ends_launch`` (``SIGINT`` is a stop request, not a failure)."""

import runpy
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _fail(signum, frame):  # noqa: ARG001
    raise RuntimeError("injected failure")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    signal.signal(signal.SIGALRM, _fail)
    sys.argv[0] = str(REPO / "finetune/run.py")
    runpy.run_path(str(REPO / "finetune/run.py"), run_name="__main__")
