"""The objectives NCA and kNCA maximise, and how they are evaluated without N x N memory.

* ``nca.py``: the objective interface and NCA's f(A) = sum_i p_i and g(A) = sum_i log p_i
  (Goldberger et al. 2004, eqs 1-7) (``tests/training/objectives/test_objectives.py``).
* ``knca.py``: kNCA (Tarlow et al. 2013): the expected accuracy of a k-NN vote, majority and
  all-correct, and their logs (``tests/training/objectives/test_knca.py``).
* ``registry.py``: objective names to objects (the CLI's ``--objective`` values).
* ``neighbourhood.py``: the dispatcher: exact evaluation in row chunks against all points,
  or against candidate sets per point (``tests/training/optim/test_candidate_*.py``).
* ``nca_kernel.py``: NCA's fused closed-form value and gradient (torch; on CUDA also
  ``nca_flex.py``).
* ``native.py`` (loading), ``native_candidates.py``, ``knca_native.py``, ``native_rows.py``:
  NCA on candidate sets, kNCA and exact NCA's row pass in C (``kernels/*.c``), built at
  install (``setup.py``, ``kernels/levels.py``) and loaded with ctypes; torch is the fallback
  (``test_native.py``, ``test_native_candidates.py``, ``test_knca_native.py``,
  ``test_native_rows.py``).
"""
