"""The training job's artifacts served: what the job reports offline is what the service
answers online, and the service's projection is the estimator's transform. Needs torch and
scikit-learn (the ``train`` extra); the service's own tests do not."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.infer import embed, infer_one, resolve
from service.engine.model import load_model
from service.search.index import search
from tests.service.conftest import settings_for

pytest.importorskip("torch")

from training import NCA
from training.config import TrainConfig
from training.data.datasets import load_dataset, make_split
from training.job import run

DIGITS_CONFIG = dict(data="digits", n_components=16, max_iter=40, quiet=True, plots=False, seed=0)


@pytest.fixture(scope="module")
def trained_digits(tmp_path_factory):
    """(artifact path, report dict, split) for digits, trained by the real job."""
    out = tmp_path_factory.mktemp("models") / "digits"
    config = TrainConfig(out=str(out), **DIGITS_CONFIG)
    report = run(config, log=lambda message: None)
    split = make_split(
        load_dataset("digits"),
        test_size=config.test_size,
        val_size=config.val_size,
        seed=config.seed,
    )
    return out, report, split


def served(model, x, k: int, rule: str):
    """What the service's inference path answers for rows x with k and rule (the
    calibration's default outlier threshold)."""
    query = resolve(model, model.n_references, k=k, rule=rule)
    return infer_one(model, np.asarray(x, dtype=np.float32), query)


def test_service_predictions_equal_the_training_report(trained_digits):
    path, report, split = trained_digits
    model = load_model(path, settings_for(path))
    k = report["test_predictions"]["k"]
    answer = served(model, split.X_test, k, report["test_predictions"]["rule"])
    labels = [model.classes[c] for c in answer.predicted]
    assert labels == report["test_predictions"]["label"]
    accuracy = float(np.mean(np.array(labels) == split.classes[split.y_test]))
    assert accuracy == pytest.approx(report["metrics"]["test_accuracy"][k])


def test_service_projection_equals_estimator_transform(tmp_path):
    from sklearn.datasets import load_digits

    from service.core.artifact import write_artifact

    X, y = load_digits(return_X_y=True)
    nca = NCA(n_components=8, max_iter=20, random_state=0).fit(X[:500], y[:500])
    path = write_artifact(
        tmp_path / "m",
        projection=nca.projection_,
        offset=nca.offset_,
        embeddings=nca.transform(X[:500]),
        labels=y[:500].astype(np.int32),
        classes=list(range(10)),
        mean=nca.mean_,
        scale=nca.scale_,
        default_k=1,
    )
    model = load_model(path, settings_for(path))
    np.testing.assert_array_equal(embed(model, X[500:]), nca.transform(X[500:]))


def test_far_away_offline_equals_online(trained_digits):
    """The outlier flags and the soft_prior rule: the job's report and the offline functions
    give what the service serves; on a trained model the prior rule stays within a few
    hundredths of the soft rule for typical queries (the threshold lies beyond them)."""
    from service.core.knn import outlier_flags
    from training.evaluation.calibration import threshold_of
    from training.evaluation.evaluate import knn_predictions

    path, report, split = trained_digits
    model = load_model(path, settings_for(path))
    calibration = model.artifact.manifest["outlier_calibration"]
    threshold = threshold_of(calibration)
    assert model.default_outlier_threshold == threshold
    k = report["test_predictions"]["k"]
    z_test = embed(model, split.X_test)
    dist, _ = search(model, z_test, k)
    assert int(outlier_flags(dist, threshold).sum()) == report["metrics"]["outliers"]["n_flagged"]
    offline = knn_predictions(
        model.embeddings,
        model.labels,
        z_test,
        len(model.classes),
        (5,),
        "soft_prior",
        outlier_threshold=threshold,
    )[5]
    online = served(model, split.X_test, 5, "soft_prior")
    assert online.predicted.tolist() == list(offline)
    soft = served(model, split.X_test, 5, "soft")
    gap = np.abs(online.probabilities - soft.probabilities).max(axis=1)
    nearest = online.distances[:, 0]
    # how far the component reaches in depends on the map's learned scale (a smaller map
    # brings it closer). Measured from the calibrated initial map (init_scale="auto"):
    # 0.038 up to the median, 0.11 up to the 0.9-quantile, 0.35 at the farthest; from the
    # map as built (init_scale=1.0), which ends larger: 1.5e-4, 7e-3, 0.51
    assert gap[nearest <= np.median(nearest)].max() < 0.05


def test_every_manifest_field_of_a_trained_model_is_classified(trained_digits):
    """Each field the training job writes is either descriptive (not in the model version)
    or one of the fields below that change answers; a new field must be placed in one of the
    two on purpose (an unplaced one counts towards the version)."""
    from service.core.artifact import DESCRIPTIVE_MANIFEST_KEYS, read_artifact

    answering = {
        "format",
        "schema_version",
        "n_features_in",
        "n_components",
        "n_references",
        "n_validation",
        "classes",
        "default_k",
        "decision_rule",
        "standardization",
        "outlier_calibration",
    }
    manifest = read_artifact(trained_digits[0]).manifest
    assert set(manifest) - DESCRIPTIVE_MANIFEST_KEYS == answering
