"""nca-knn offline half: learn a linear map A by NCA / kNCA and export a servable artifact.

``NCA`` is imported on first use (PEP 562), so that ``python -m training`` can set its
signal handlers before torch is imported (``training.__main__``)."""

__all__ = ["NCA"]


def __getattr__(name: str):
    if name == "NCA":
        from training.model.estimator import NCA

        return NCA
    raise AttributeError(f"module 'training' has no attribute {name!r}")
