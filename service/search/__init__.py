"""Search over the reference embeddings.

* ``index.py``: FAISS indexes at run time (flat, IVF, HNSW, IVF-PQ), exact re-ranking, the
  exact fallback for far queries and under-filled answers, the two-stage recheck
  (``tests/service/search/test_index.py``).
* ``tuning.py``: ``nca-index``, the offline command that builds an index and tunes its search
  parameter on the validation split by label agreement (``tests/service/search/test_indexing.py``).
"""
