"""What the fit's loop (``training.model.fitting``) drives: the loss as a function of the map,
candidate sets, and the two optimisers, each taking one step when asked.

The loss of a stage is

    L(A) = -(1 / |rows|) sum_{i in rows} score_i(A) + l2 * ||A||_F^2

where score_i is the objective's per-point score (see ``training.objectives.nca``) evaluated
exactly (chunks against all points) or on candidate sets, recomputed in the current
projection when they go stale.

* ``problem.py``: ``Problem``, the loss and gradient of the flattened map on all rows or a
  batch, exactly or on candidate sets.
* ``sharded_problem.py``: ``ShardedProblem``, the ``Problem`` of one rank's row shard under
  torchrun, whose value and gradient equal one process's.
* ``candidates.py``: candidate sets, found by FAISS IVF indexes at scale (their held mass
  measured against exact sets); the audit of the sets on fixed rows, and
  ``CandidateWatch``, which says when they are stale and how many to keep.
* ``lbfgs.py``: L-BFGS with a strong-Wolfe line search, one iteration a step;
  ``adam.py``: mini-batch Adam, one epoch a step.

Tests: ``tests/training/optim/``, and the loop's through the estimator
(``tests/training/model/test_estimator.py``, ``tests/training/optim/test_stages.py``,
``test_stage_guard.py``, ``test_exact_finish.py``).
"""
