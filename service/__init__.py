"""nca-knn online half: the artifact contract, the kNN core and the HTTP service.

Importing this package (or ``service.artifact`` / ``service.knn``) pulls in numpy
and the standard library only; the web stack and FAISS load from their own modules.
"""

__version__ = "0.1.0"
