"""Optimisation: the objective as a function of the map, candidate sets kept honest, the
monitor and the optimisers (full-batch L-BFGS, mini-batch Adam).

* ``optimize.py``: ``Problem``, candidate diagnostics, ``Monitor``, ``run_lbfgs`` and
  ``run_adam`` (``tests/training/test_estimator.py``, ``test_candidate_audit.py``,
  ``test_exact_finish.py``).
"""
