"""Fixtures shared by the training tests."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.conftest import build_model_artifact, digits_like_split

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def digits_like_model(tmp_path_factory):
    """(artifact path, split): a model on the service tests' digits-like split, whose test
    rows serve as new data. Tests must not change it (they write new versions elsewhere)."""
    out = tmp_path_factory.mktemp("digits-like-model") / "base"
    split = digits_like_split()
    build_model_artifact(out, split)
    return out, split


# The process behind ``python_m_training``: it imports training.cli (torch, scikit-learn,
# the service's artifact code: ~3 s) once, then forks one child per request, which runs
# ``python -m training ARGS`` as the interpreter's -m does (runpy, training/__main__.py as
# __main__), under the request's file-size limit, with its stdout and stderr in pipes.
FORKING_PYTHON = r"""
import json, os, resource, runpy, selectors, sys, traceback

import training.cli  # noqa: F401

def run(request):
    if request["file_size_limit"]:
        limit = request["file_size_limit"]
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    exec(request["prelude"], {"__name__": "__prelude__"})
    sys.argv = ["-m", *request["args"]]
    runpy.run_module("training", run_name="__main__", alter_sys=True)

def child(request, out, err):
    os.dup2(out, 1)
    os.dup2(err, 2)
    code = 0
    try:
        run(request)
    except SystemExit as exc:  # as the interpreter ends on it
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code & 0xFF)

def output(fds):
    chunks = {fd: [] for fd in fds}
    with selectors.DefaultSelector() as selector:
        for fd in fds:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            for key, _ in selector.select():
                chunk = os.read(key.fd, 65536)
                if chunk:
                    chunks[key.fd].append(chunk)
                else:
                    selector.unregister(key.fd)
                    os.close(key.fd)
    return [b"".join(chunks[fd]).decode(errors="replace") for fd in fds]

for line in sys.stdin:
    request = json.loads(line)
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        os.close(err_r)
        child(request, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    stdout, stderr = output([out_r, err_r])
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    print(json.dumps({"returncode": code, "stdout": stdout, "stderr": stderr}), flush=True)
"""


@pytest.fixture(scope="session")
def python_m_training():
    """``python_m_training(*args, file_size_limit=None, prelude="")``: (exit status, stdout,
    stderr) of ``python -m training ARGS`` in a process of its own, a fork of one process
    that imported training.cli once (each command starts in ~0.1 s, not ~3 s). The child
    takes the file-size limit (RLIMIT_FSIZE) first, runs ``prelude`` (Python: to patch a
    module), then the module; its exit status is the interpreter's (SystemExit's code, 1 on
    an uncaught exception with its traceback on stderr, -N when killed by signal N). Python
    writes no bytecode there: a .pyc over the limit would be written before the command's
    own code runs. What a fresh interpreter does before the command's code (its imports)
    is tested by the commands the tests run with subprocess."""
    server = subprocess.Popen(
        [sys.executable, "-c", FORKING_PYTHON],
        cwd=ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def run(*args, file_size_limit: int | None = None, prelude: str = "", timeout: float = 300):
        request = {"args": list(map(str, args)), "file_size_limit": file_size_limit}
        server.stdin.write(json.dumps({**request, "prelude": prelude}) + "\n")
        server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        if not ready:
            server.kill()  # and with it every later command: one stuck child fails them
            pytest.fail(f"python -m training {' '.join(request['args'])}: running {timeout} s")
        line = server.stdout.readline()
        assert line, f"the forking process ended: {server.wait()}"
        done = json.loads(line)
        return done["returncode"], done["stdout"], done["stderr"]

    try:
        yield run
    finally:
        server.kill()
        server.wait()
