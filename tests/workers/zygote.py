"""A fork server for the tests' job processes: imports torch and Lightning once, then forks each process.

Started once per test session by :class:`tests.launch.Zygote` (``python -m tests.workers.zygote``).
On 2 cores a fresh rank spends some 6 s of CPU importing torch and Lightning before it runs a
line of the job; a forked one starts with them imported. Nothing else is imported here: the job's
own modules (``lightning_gpipe``, ``tests.models``, which picks its Lightning namespace from the
job's environment) are imported by the rank, after its environment is in place.

Protocol (one JSON object per line): a request ``{"processes": [{"argv", "env", "cwd", "log"}]}``
is answered with ``{"pids": [...]}`` once every process is forked, then ``{"rcs": [...]}`` (exit
codes as ``subprocess`` gives them: ``-signal`` when killed) once all have ended. Each process
leads a session (and process group) of its own, runs ``argv[1]`` as ``__main__`` with
``argv[1:]`` as ``sys.argv``, its output (stdout and stderr) in the file ``log``, and runs the
interpreter's exit hooks before it exits, as a fresh ``python argv...`` would.
"""

import atexit
import json
import os
import runpy
import sys
import threading

import pytorch_lightning  # noqa: F401, I001
import torch  # noqa: F401  (the point: imported once, before any fork)

try:
    import lightning.pytorch  # noqa: F401
except ImportError:  # the "lightning" package is optional outside the tests' extras
    pass


def _child(proc: dict) -> int:
    os.setsid()
    log = os.open(proc["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.clear()
    os.environ.update(proc["env"])
    os.chdir(proc["cwd"])
    sys.argv = list(proc["argv"][1:])
    script = os.path.abspath(sys.argv[0])
    extra = [p for p in proc["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *[p for p in sys.path[1:] if p not in extra]]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would: through sys.excepthook
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined] - as the interpreter's exit: threads, then exit hooks
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def main() -> None:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        pids = []
        for proc in request["processes"]:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _child(proc)
                finally:
                    os._exit(code)
            pids.append(pid)
        reply.write(json.dumps({"pids": pids}) + "\n")
        rcs = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        reply.write(json.dumps({"rcs": rcs}) + "\n")


if __name__ == "__main__":
    main()
