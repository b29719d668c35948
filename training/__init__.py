"""nca-knn offline half: learn a linear map A by NCA / kNCA and export a servable artifact."""

from training.model.estimator import NCA

__all__ = ["NCA"]
