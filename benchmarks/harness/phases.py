"""Where a fit's time goes: ``PhaseClock`` wraps the preparation, every candidate refresh
and every exact NCA evaluation on the CPU (the torch path), and records their wall times."""

from __future__ import annotations

import time

from training.model import preparation
from training.objectives import nca_kernel
from training.optim import candidates as candidate_module


class PhaseClock:
    """Wall time of the preparation, of every candidate refresh and of every exact
    evaluation on the CPU, by wrapping them."""

    def __init__(self):
        self.prepare_s = 0.0
        self.refresh_s: list[float] = []
        self.exact_s: list[float] = []

    def __enter__(self):
        self._prepare = preparation.prepare
        self._refresh = candidate_module.CandidateWatch.refresh
        self._exact = nca_kernel._torch_value_and_grad
        clock = self

        def exact(*args, **kwargs):
            started = time.perf_counter()
            try:
                return clock._exact(*args, **kwargs)
            finally:
                clock.exact_s.append(time.perf_counter() - started)

        def prepare(*args, **kwargs):
            started = time.perf_counter()
            try:
                return clock._prepare(*args, **kwargs)
            finally:
                clock.prepare_s += time.perf_counter() - started

        def refresh(watch, theta):
            started = time.perf_counter()
            try:
                return clock._refresh(watch, theta)
            finally:
                clock.refresh_s.append(time.perf_counter() - started)

        preparation.prepare = prepare
        candidate_module.CandidateWatch.refresh = refresh
        nca_kernel._torch_value_and_grad = exact
        return self

    def __exit__(self, *exc):
        preparation.prepare = self._prepare
        candidate_module.CandidateWatch.refresh = self._refresh
        nca_kernel._torch_value_and_grad = self._exact
