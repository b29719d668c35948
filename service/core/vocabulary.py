"""The names the service, the artifact and the training job share: decision rules and index
kinds, each defined once here (standard library only, so every layer may import it).

Everything else derives from these enums: the artifact's checks, the request types and the
OpenAPI enumerations, the CLI choices, the settings' types.
"""

from __future__ import annotations

import enum


class DecisionRule(str, enum.Enum):
    """How k neighbours' labels become a prediction (``service.core.knn.decide``)."""

    MAJORITY = "majority"  # the most frequent label; ties go to the nearest tied neighbour
    SOFT = "soft"  # NCA's softmax of minus squared distances over the k neighbours
    # the soft rule plus a per-class component at the data's mean (Barber 14.3.1): far from
    # every reference the probabilities tend to the class priors (needs the outlier calibration)
    SOFT_PRIOR = "soft_prior"


class IndexKind(str, enum.Enum):
    """The FAISS index over the references (``service.search.index.build_index``)."""

    FLAT = "flat"  # exact
    IVF = "ivf"  # inverted lists of full vectors; search parameter nprobe
    HNSW = "hnsw"  # graph; search parameter efSearch
    IVFPQ = "ivfpq"  # inverted lists of product-quantised codes; nprobe


RULES: tuple[str, ...] = tuple(rule.value for rule in DecisionRule)
# the rules that need nothing but the neighbours: an artifact's default rule and the rule that
# scores validation during training (soft_prior needs a calibration made after training)
NEIGHBOUR_RULES: tuple[str, ...] = (DecisionRule.MAJORITY.value, DecisionRule.SOFT.value)
INDEX_KINDS: tuple[str, ...] = tuple(kind.value for kind in IndexKind)
IVF_KINDS: tuple[str, ...] = (IndexKind.IVF.value, IndexKind.IVFPQ.value)  # probe with nprobe
