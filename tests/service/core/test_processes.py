"""service.core.processes.process_alive: this process, a child that has ended, and numbers
that name no single process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.core.processes import process_alive


def test_this_process_and_its_parent_are_alive():
    assert process_alive(os.getpid()) and process_alive(os.getppid())


def test_a_child_that_has_been_reaped_is_not():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid)


@pytest.mark.parametrize("pid", [0, -1, -os.getpid(), 2**63, 2**200])
def test_numbers_that_name_no_single_process_are_not_alive(pid):
    assert not process_alive(pid)


def test_another_users_process_is_alive():
    if os.geteuid() == 0:
        pytest.skip("root may signal every process")
    assert process_alive(1)  # init, owned by root: EPERM
