"""What the engine reports as it runs: the events its owner turns into metrics.

The engine knows no metrics library. It calls one :class:`EngineEvents` object, whose
methods do nothing here; ``service.ops.metrics.Metrics`` overrides them with Prometheus
counters, gauges and histograms, and a test can override them to record what happened.
"""

from __future__ import annotations


class EngineEvents:
    """Every event the engine reports, each a no-op by default."""

    def model_loaded(self, model) -> None:
        """A load swapped ``model`` (a ``LoadedModel``) in."""

    def model_load_failed(self, error: Exception) -> None:
        """A load failed with ``error``; the previous model keeps serving."""

    def search_fell_back(self, far_rows: int, underfilled_rows: int) -> None:
        """A search answered rows exactly instead of through the index (far: too far from
        the data for float32; underfilled: the index found fewer than k)."""

    def request_admitted(self, route: str, rows: int) -> None:
        """A request of ``rows`` instances on ``route`` passed the in-flight gate."""

    def request_done(self) -> None:
        """An admitted request left the engine (answered or failed)."""

    def outliers_flagged(self, count: int) -> None:
        """A classification flagged ``count`` of its rows as outliers."""

    def batch_searched(self, rows: int, waited_seconds: float) -> None:
        """The batcher searched ``rows`` rows at once; its oldest request waited this long."""

    def model_request(self, name: str, rows: int) -> None:
        """A request of ``rows`` instances to the repository's model ``name`` was admitted."""

    def repository_model_ready(self, name: str, nbytes: int) -> None:
        """The repository's model ``name`` serves, holding ``nbytes`` of memory."""

    def repository_model_removed(self, name: str) -> None:
        """The repository's model ``name`` was unloaded: its series go."""
