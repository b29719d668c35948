"""Optimisers for neighbourhood objectives: full-batch L-BFGS and mini-batch Adam.

Both minimise the loss

    L(A) = -(1 / |rows|) sum_{i in rows} score_i(A) + l2 * ||A||_F^2

where score_i is the objective's per-point score (see ``training.objectives.nca``) evaluated
exactly (chunks against all points) or on candidate sets. With candidate sets the
optimisation runs in rounds: candidates are recomputed in the current projection, then the
optimiser runs until the :class:`CandidateWatch` finds them stale, or for at most
``refresh_every`` iterations (L-BFGS restarts each round, since its curvature pairs belong
to the previous objective).

A :class:`Monitor` sees every iteration: it prints the verbose table, records the history,
and implements early stopping on validation kNN accuracy (keeping the best parameters).

* ``problem.py``: ``Problem``, the loss and gradient of the flattened map on all rows or a
  batch, exactly or on candidate sets.
* ``candidates.py``: the audit of candidate sets on fixed rows, and ``CandidateWatch``.
* ``candidate_search.py``: candidate sets by FAISS IVF indexes at scale, their held mass
  measured against exact sets.
* ``stages.py``: the rules of a stage: ``StageJudge`` keeps the better of its start and end,
  ``StageGuard`` stops it when it stalls or the fit's budget (``FitClock``) is spent, and
  ``StageRecord`` says what it did.
* ``sharded_problem.py``: ``ShardedProblem``, the ``Problem`` of one rank's row shard under
  torchrun, whose value and gradient equal one process's.
* ``monitor.py``: ``Monitor`` (verbose table, history, early stopping) and ``FitResult``.
* ``lbfgs.py``, ``adam.py``: the two optimisers; ``finish.py``: the exact finish after
  candidate sets.

Tests: ``tests/training/model/test_estimator.py``, ``test_helpers.py``, ``test_candidate_audit.py``,
``test_candidate_draws.py``, ``test_candidate_search.py``, ``test_candidate_rows.py``,
``test_stages.py``, ``test_stage_guard.py``, ``test_exact_finish.py``, ``test_distributed.py``.
"""
