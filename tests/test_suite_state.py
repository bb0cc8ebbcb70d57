"""The test suite leaves its caller's shell as it found it: terminal modes, signal handlers, open fds, process group
and the terminal's foreground group, whether pytest runs in the background or the foreground.

Runs tests/suite_state_check.sh on one small test that plays with SIGINT (chat's Ctrl-C test), under a pseudo-terminal
from `script` when there is one so job control, SIGTTOU/SIGTTIN and `stty` are covered; without a pty, the checks that
need no terminal still run. The whole suite: `tests/suite_state_check.sh` (docs/testing.md).
"""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "suite_state_check.sh"
SUBSET = ["tests/test_chat.py", "-k", "ctrl_c"]


def _run(command, **kwargs):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, **kwargs)


def _pty_works() -> bool:
    if shutil.which("script") is None:
        return False
    try:
        probe = _run(["script", "-qec", "test -t 0", "/dev/null"])
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def test_the_suite_leaves_the_shell_unchanged():
    command = ["bash", str(SCRIPT), *SUBSET]
    if _pty_works():
        # A new session with its own terminal: job control on, the background run in its own process group.
        result = _run(["script", "-qec", shlex.join(command), "/dev/null"])
    else:  # no pty here: signal dispositions, fds and the process group are still compared
        result = _run(["setsid", *command] if shutil.which("setsid") else command)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "background run done (pytest status 0), script continues" in out, out
    assert "foreground run done (pytest status 0), script continues" in out, out
    assert "OK, state unchanged" in out, out
