"""Shared fixtures. Data sets come from scikit-learn or are generated; USPS is optional."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
USPS_PATH = ROOT.parent / "shared" / "data" / "usps.npz"


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def usps():
    """USPS digits (X, y, X_test, y_test), skipped when ../shared/data/usps.npz is absent."""
    if not USPS_PATH.is_file():
        pytest.skip(f"USPS data not found at {USPS_PATH}")
    with np.load(USPS_PATH, allow_pickle=False) as data:
        return data["X"], data["y"], data["X_test"], data["y_test"]


def make_rings(n_per_class: int, noise_std: float, seed: int):
    """The NCA paper's concentric rings: 5 classes on circles of radius 1..5 in (x1, x2),
    plus a third, high-variance Gaussian noise dimension unrelated to the class."""
    rng = np.random.default_rng(seed)
    X, y = [], []
    for c in range(5):
        angle = rng.uniform(0, 2 * np.pi, n_per_class)
        radius = (c + 1) + rng.normal(0, 0.05, n_per_class)
        noise = rng.normal(0, noise_std, n_per_class)
        X.append(np.column_stack([radius * np.cos(angle), radius * np.sin(angle), noise]))
        y.append(np.full(n_per_class, c))
    return np.vstack(X), np.concatenate(y)


# The process behind ``python_m_training``: it imports training.cli (torch, scikit-learn,
# the service's artifact code: ~3 s) once, then forks one child per request, which runs
# ``python -m training ARGS`` as the interpreter's -m does (runpy, training/__main__.py as
# __main__), under the request's file-size limit, its stdout in a pipe or on a given path,
# its stderr in a pipe.
FORKING_PYTHON = r"""
import json, os, resource, runpy, selectors, sys, traceback

import training.cli  # noqa: F401

def run(request, out, err):
    os.dup2(out, 1)
    os.dup2(err, 2)
    if request["file_size_limit"]:
        limit = request["file_size_limit"]
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    exec(request["prelude"], {"__name__": "__prelude__"})
    sys.argv = ["-m", *request["args"]]
    runpy.run_module("training", run_name="__main__", alter_sys=True)

def child(request, out, err):
    if request["finalize"]:  # SystemExit or an exception ends the interpreter, as in any
        run(request, out, err)  # script: its traceback, exit status and last flush
        sys.exit(0)
    code = 0
    try:
        run(request, out, err)
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
    if request["stdout"]:
        os.close(out_w)
        out_w = os.open(request["stdout"], os.O_WRONLY)
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
    """``python_m_training(*args, file_size_limit=None, prelude="", stdout=None,
    finalize=False)``: (exit status, stdout, stderr) of ``python -m training ARGS`` in a
    process of its own, a fork of one process that imported training.cli once (each command
    starts in ~0.1 s, not ~3 s). The child takes the file-size limit (RLIMIT_FSIZE) first,
    runs ``prelude`` (Python: to patch a module), then the module, its stdout on the path
    ``stdout`` when given (then "" comes back). With ``finalize`` it ends as an interpreter
    does (SystemExit or the uncaught exception reaching the top, the interpreter's teardown
    and last flush of stdout: exit status 120 when that fails; ~0.8 s); without, its exit
    status is the one the interpreter would give (SystemExit's code, 1 with the traceback on
    an uncaught exception) and it leaves by os._exit once stdout and stderr are flushed.
    Killed by signal N: -N. Python writes no bytecode there: a .pyc over the limit would be
    written before the command's own code runs. What a fresh interpreter does before the
    command's code (its imports) is tested by the commands the tests run with subprocess."""
    server = subprocess.Popen(
        [sys.executable, "-c", FORKING_PYTHON],
        cwd=ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def run(
        *args,
        file_size_limit: int | None = None,
        prelude: str = "",
        stdout: str | None = None,
        finalize: bool = False,
        timeout: float = 300,
    ):
        request = {"args": list(map(str, args)), "file_size_limit": file_size_limit}
        request.update(prelude=prelude, stdout=stdout, finalize=finalize)
        server.stdin.write(json.dumps(request) + "\n")
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
