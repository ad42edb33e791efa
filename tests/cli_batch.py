"""Several ``jaxguard`` commands in one fresh Python process (shared by the CLI tests).

Each command starting its own interpreter pays the imports of jax, torch and jaxguard
again (about 4 s of CPU on the 2-core development machine); commands whose checks are about
what the command prints and writes, not about what the process imported or tuned, run
here one after another in one process, each through `jaxguard.cli.main.main` as
``python -m jaxguard`` calls it.  What a command prints to stdout and stderr is kept apart
per command; an exception that escapes it is written to its stderr as the interpreter
would (a ``Traceback``, status 1), so a check for "one line, no traceback" sees it.
Warnings are shown per command as in a fresh process (the registry of warnings already
shown is reset between commands).
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RUNNER = r"""
import contextlib, io, json, sys, traceback, warnings
from jaxguard.cli.main import main
done = []
for argv in json.loads(sys.stdin.read()):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        try:
            rc = main(argv)
        except SystemExit as exc:   # argparse's refusals
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:   # noqa: BLE001 - what the interpreter would print
            traceback.print_exc()
            rc = 1
    done.append({"args": argv, "returncode": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
sys.__stdout__.write("\n" + json.dumps(done) + "\n")
"""


def run_cli_batch(commands, *, env=None, cwd=None, timeout=900):
    """Run `commands` (each a list of ``jaxguard`` arguments) in one fresh process.

    Args:
      commands: the argument lists, run in this order.
      env: the process's environment (default: this one's, with the repository on PYTHONPATH).
      cwd: its working directory.
      timeout: seconds for all of them.

    Returns:
      One `subprocess.CompletedProcess` per command (args, returncode, stdout, stderr).
    """
    if env is None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    argvs = [[str(a) for a in c] for c in commands]
    p = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(argvs), capture_output=True, text=True,
                       env=env, cwd=cwd, timeout=timeout)
    assert p.returncode == 0 and p.stdout.strip(), p.stderr[-3000:]
    return [subprocess.CompletedProcess(d["args"], d["returncode"], d["stdout"], d["stderr"])
            for d in json.loads(p.stdout.strip().splitlines()[-1])]
