"""The /v1 request bodies as msgspec structs: one strict decode (``service.wire.parse_json``)
refuses numbers that are not JSON numbers, a ``k`` that is not an integer, a
``return_neighbors`` that is not a boolean, and unknown fields (422)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from service.core.vocabulary import RULES

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Rule = Literal[RULES]  # type: ignore[valid-type]  (the values of DecisionRule)


class InstancesBody(msgspec.Struct, forbid_unknown_fields=True):
    instances: list[list[float]]


class EmbedBody(InstancesBody, forbid_unknown_fields=True):
    pass


class NeighborsBody(InstancesBody, forbid_unknown_fields=True):
    k: PositiveInt | None = None


class ClassifyBody(InstancesBody, forbid_unknown_fields=True):
    k: PositiveInt | None = None
    rule: Rule | None = None
    return_neighbors: bool = False
    outlier_quantile: float | None = None
