"""The benchmarks' one harness; each script in ``benchmarks/`` names a configuration and
calls these:

* ``data.py``: the data sets (``synthetic``: clustered classes in a subspace; ``usps_784``:
  real digits at MNIST's size, from ../shared/data/usps.npz).
* ``models.py``: the served artifacts the HTTP benchmarks load (``build_models``).
* ``servers.py``: starting a server (``python -m service`` or a uvicorn app) pinned to its
  core, waiting until it is ready, stopping it.
* ``load.py``: ``wrk`` pinned to the load core, and its output parsed.
* ``report.py``: the machine, medians, peak memory, a printed table and the JSON written to
  ``benchmarks/results/`` (atomically).

Scripts run as ``python benchmarks/<script>.py`` put ``benchmarks/`` on the path and import
``harness.<module>``.
"""
