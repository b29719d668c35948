"""Learned reference sets (``training.references.learned``): the objective and its closed-form
gradient, toy problems with known answers, determinism, the condense command, the training
job's joint mode, and the served answers of a compressed model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from service.app import create_app
from service.core.artifact import read_artifact
from service.core.knn import project
from service.engine.infer import infer_one, resolve
from service.engine.model import load_model
from tests.service.conftest import settings_for
from training import NCA
from training.cli import main as cli_main
from training.evaluation.evaluate import knn_predictions
from training.references.condense import budget_record
from training.references.learned import (
    PrototypeProblem,
    check_budget,
    class_budget,
    initial_prototypes,
    learn_prototypes,
    representatives,
)
from training.references.versions import ReferenceError, condense_references, remove_references


def autograd_loss(u, y, z, labels, g, loss):
    """The objective written the plain way (float64, autograd, no chunks): the reference the
    closed-form gradient is checked against."""
    d2 = ((u[:, None, :] - z[None, :, :]) ** 2).sum(-1)  # (N, M)
    p = torch.softmax(-g * d2, dim=1)
    p_i = (p * (y[:, None] == labels[None, :])).sum(1)
    return -torch.log(p_i).mean() if loss == "log" else 1.0 - p_i.mean()


def small_problem(seed=0, n=120, d=3, big_d=5, n_classes=3, per_class=3):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, n_classes, n)
    x = rng.normal(size=(n, big_d)) + y[:, None]
    a = rng.normal(size=(d, big_d)) * 0.5
    labels = np.repeat(np.arange(n_classes), per_class)
    z = rng.normal(size=(len(labels), d)) + labels[:, None] * 0.5
    return x, y, a, labels, z


@pytest.mark.parametrize("loss", ["log", "f"])
@pytest.mark.parametrize("joint", [False, True])
def test_closed_form_gradient_equals_autograd(loss, joint):
    x, y, a, labels, z = small_problem()
    log_g = 0.3
    u_fixed = x @ a.T
    problem = PrototypeProblem(
        x if joint else u_fixed,
        y,
        labels,
        n_components=z.shape[1],
        joint=joint,
        loss=loss,
        chunk_rows=17,
        dtype=torch.float64,
    )
    theta = np.concatenate([z.ravel(), a.ravel() if joint else [log_g]])
    value, grad = problem.loss_and_grad(theta)

    zt = torch.tensor(z, requires_grad=True)
    yt, lt = torch.tensor(y), torch.tensor(labels)
    if joint:
        at = torch.tensor(a, requires_grad=True)
        reference = autograd_loss(torch.tensor(x) @ at.T, yt, zt, lt, 1.0, loss)
        reference.backward()
        expected = np.concatenate([zt.grad.numpy().ravel(), at.grad.numpy().ravel()])
    else:
        st = torch.tensor(log_g, dtype=torch.float64, requires_grad=True)
        reference = autograd_loss(torch.tensor(u_fixed), yt, zt, lt, st.exp(), loss)
        reference.backward()
        expected = np.concatenate([zt.grad.numpy().ravel(), [st.grad.item()]])
    assert value == pytest.approx(reference.item(), rel=1e-12)
    np.testing.assert_allclose(grad, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("loss", ["log", "f"])
def test_gradient_against_central_finite_differences(loss):
    x, y, a, labels, z = small_problem(seed=3)
    problem = PrototypeProblem(
        x, y, labels, n_components=z.shape[1], joint=True, loss=loss, dtype=torch.float64
    )
    theta = np.concatenate([z.ravel(), a.ravel()])
    _, grad = problem.loss_and_grad(theta)
    rng = np.random.default_rng(0)
    for i in rng.choice(len(theta), 12, replace=False):
        step = np.zeros_like(theta)
        step[i] = 1e-6
        numeric = problem.loss_and_grad(theta + step)[0] - problem.loss_and_grad(theta - step)[0]
        assert numeric / 2e-6 == pytest.approx(grad[i], rel=1e-5, abs=1e-9)


def test_the_chunk_size_does_not_change_the_value_or_the_gradient():
    x, y, a, labels, z = small_problem(seed=5)
    theta = np.concatenate([z.ravel(), [0.1]])
    answers = [
        PrototypeProblem(
            x @ a.T, y, labels, n_components=3, joint=False, chunk_rows=rows, dtype=torch.float64
        ).loss_and_grad(theta)
        for rows in (1, 7, 4096)
    ]
    for value, grad in answers[1:]:
        assert value == pytest.approx(answers[0][0], rel=1e-12)
        np.testing.assert_allclose(grad, answers[0][1], rtol=1e-10, atol=1e-14)


def test_every_other_training_point_as_prototypes_is_ncas_objective():
    # NCA (Goldberger et al., eqs 1-3): p_ij = softmax over j != i of -||A x_i - A x_j||^2,
    # f(A) = sum_i p_i. Scoring each point against all the others as prototypes (g = 1) is
    # exactly that; computed here by brute force over every pair.
    x, y, a, _, _ = small_problem(seed=7, n=40)
    u = x @ a.T
    d2 = ((u[:, None] - u[None]) ** 2).sum(-1)
    np.fill_diagonal(d2, np.inf)
    p = np.exp(-d2 - np.log(np.exp(-d2).sum(1, keepdims=True)))
    nca_f = (p * (y[:, None] == y[None])).sum()
    total = 0.0
    for i in range(len(u)):
        others = np.delete(np.arange(len(u)), i)
        order = others[np.argsort(y[others], kind="stable")]  # prototypes sorted by class
        problem = PrototypeProblem(
            u[[i]], y[[i]], y[order], n_components=3, joint=False, loss="f", dtype=torch.float64
        )
        value, _ = problem.loss_and_grad(np.concatenate([u[order].ravel(), [0.0]]))
        total += 1.0 - value  # the f loss of one row is 1 - p_i
    assert total == pytest.approx(nca_f, rel=1e-10)


def gaussian_classes(n_per_class=200, n_classes=4, spread=0.3, seed=0, d=2):
    rng = np.random.default_rng(seed)
    means = 6.0 * rng.normal(size=(n_classes, d))
    y = np.repeat(np.arange(n_classes), n_per_class)
    return means[y] + spread * rng.normal(size=(len(y), d)), y, means


def test_one_prototype_per_well_separated_class_lands_at_its_mean():
    u, y, means = gaussian_classes()
    fit = learn_prototypes(u, y, reduction=200, max_iter=100)
    assert fit.labels.tolist() == [0, 1, 2, 3]
    # the objective is flat near the mean for separated classes: it stays near it
    np.testing.assert_allclose(fit.prototypes, means, atol=0.1)
    assert fit.loss_end <= fit.loss_start + 1e-12


def test_learning_fixes_what_the_cluster_means_get_wrong():
    # two overlapping elongated classes: their means put the 1-NN boundary in the wrong place
    rng = np.random.default_rng(1)
    n = 400
    y = np.repeat([0, 1], n)
    u = np.c_[rng.normal(size=2 * n) * 3.0, rng.normal(size=2 * n) * 0.3 + 0.6 * y]
    u[y == 1, 0] += 4.0  # class 1 shifted along the long axis too
    means, labels = initial_prototypes(u, y, reduction=n)
    errors_before = (labels[((u[:, None] - means[None]) ** 2).sum(-1).argmin(1)] != y).mean()
    fit = learn_prototypes(u, y, reduction=n, max_iter=200, check_every=1000)
    nearest = ((u[:, None] - fit.prototypes[None]) ** 2).sum(-1).argmin(1)
    assert (fit.labels[nearest] != y).mean() < errors_before
    assert fit.loss_end < fit.loss_start


def test_seeded_runs_are_identical():
    u, y, _ = gaussian_classes(spread=2.0, seed=2)
    first = learn_prototypes(u, y, reduction=20, seed=4, max_iter=30)
    second = learn_prototypes(u, y, reduction=20, seed=4, max_iter=30)
    np.testing.assert_array_equal(first.prototypes, second.prototypes)
    np.testing.assert_array_equal(first.labels, second.labels)


def test_the_kept_iteration_is_the_best_on_validation():
    u, y, _ = gaussian_classes(spread=2.5, seed=3)
    uv, yv, _ = gaussian_classes(n_per_class=50, spread=2.5, seed=3)
    fit = learn_prototypes(u, y, reduction=25, x_val=uv, y_val=yv, check_every=2, max_iter=40)
    best = max(accuracy for _, accuracy in fit.history)
    kept = dict(fit.history)[fit.best_iter]
    assert kept == best
    nearest = ((uv[:, None] - fit.prototypes[None]) ** 2).sum(-1).argmin(1)
    assert (fit.labels[nearest] == yv).mean() == pytest.approx(best)


def auto_loss_problem():
    """Four classes of 140 rows and a validation split of 60, with compress's options."""
    u_all, y_all, _ = gaussian_classes(n_per_class=200, spread=2.5, seed=7)
    order = np.random.default_rng(0).permutation(len(y_all))
    u, y = u_all[order[:560]], y_all[order[:560]]
    uv, yv = u_all[order[560:]], y_all[order[560:]]
    options = dict(
        reduction=15,
        n_classes=4,
        rule="majority",
        edit_k=0,
        x_val=uv,
        y_val=yv,
        max_iter=40,
        check_every=2,
        seed=1,
    )
    return u, y, options


@pytest.fixture(scope="module")
def single_losses():
    """compress with each loss alone on ``auto_loss_problem``: {loss: Compressed}."""
    from training.references.compress import compress

    u, y, options = auto_loss_problem()
    return {loss: compress(u, y, loss=loss, **options) for loss in ("f", "log")}


@pytest.mark.parametrize(
    "scripted, expected",
    [
        ({"f": 0.80, "log": 0.90}, "log"),
        ({"f": 0.90, "log": 0.80}, "f"),
        ({"f": 0.85, "log": 0.85}, "f"),
    ],
    ids=["log better", "f better", "a tie: f"],
)
def test_auto_loss_keeps_the_loss_better_on_validation(
    monkeypatch, single_losses, scripted, expected
):
    """The validation accuracy of each loss's prototypes scripted (which loss validates
    better on real data depends on the optimiser's floating-point path): the larger one at
    the served k wins, f among equals, and auto returns that loss's own prototypes (each
    loss's fit is the one compress learned with that loss alone)."""
    from training.references import compress as compress_module

    u, y, options = auto_loss_problem()
    learning, real_served_k = [], compress_module.served_k

    def learn(*args, loss, **kwargs):
        learning.append(loss)
        return single_losses[loss].fit

    def served_k(*args):
        k, accuracy = real_served_k(*args)
        return k, {**accuracy, k: scripted[learning[-1]]}

    monkeypatch.setattr(compress_module, "learn_prototypes", learn)
    monkeypatch.setattr(compress_module, "served_k", served_k)
    auto = compress_module.compress(u, y, **options)
    assert learning == ["f", "log"] and auto.tried == scripted
    assert auto.loss == expected
    np.testing.assert_array_equal(auto.fit.prototypes, single_losses[expected].fit.prototypes)
    assert auto.k == single_losses[expected].k and single_losses["f"].tried.keys() == {"f"}
    # the two losses do reach different prototypes here, so the choice is not vacuous
    assert not np.array_equal(
        single_losses["f"].fit.prototypes, single_losses["log"].fit.prototypes
    )


def test_auto_loss_without_validation_learns_f_and_bad_losses_are_refused():
    from training.references.compress import compress, reference_set_record

    u, y, _ = gaussian_classes(spread=2.0, seed=2)
    options = dict(reduction=20, n_classes=4, rule="majority", edit_k=0, max_iter=20)
    auto = compress(u, y, **options)
    plain = compress(u, y, loss="f", **options)
    assert auto.loss == "f" and list(auto.tried) == ["f"]
    np.testing.assert_array_equal(auto.fit.prototypes, plain.fit.prototypes)
    record = reference_set_record(method="m", reduction=20.0, compressed=auto)
    assert record["objective"].startswith("NCA f loss") and record["losses_tried"] == {"f": None}
    with pytest.raises(
        ValueError, match="loss must be 'auto' or one of \\('log', 'f'\\), got 'l2'"
    ):
        compress(u, y, loss="l2", **options)


def test_budget_is_proportional_and_bad_budgets_name_the_problem():
    y = np.r_[np.zeros(100, int), np.ones(30, int), np.full(7, 2)]
    assert class_budget(y, 10) == {0: 10, 1: 3, 2: 1}
    assert check_budget(y, 3, 7) == 7.0
    for value, message in [
        (1, "must be a number > 1"),
        (0.5, "must be a number > 1"),
        (float("nan"), "must be a number > 1"),
        ("x", "must be a number > 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_budget(y, 3, value)
    with pytest.raises(ValueError, match="classes \\[3\\] have no rows"):
        check_budget(y, 4, 5)


SHUTTLE_LIKE = [34108, 37, 132, 6748, 2458, 6, 11]  # rows per class: 43,500 in 7 classes


@pytest.mark.parametrize(
    ("counts", "reduction", "expected"),
    [
        ([100, 30, 7], 10, [10, 3, 1]),  # proportional: every share at least one
        ([10, 10, 10], 3, [4, 3, 3]),  # round(30 / 3) = 10, the spare one to the lowest index
        (SHUTTLE_LIKE, 20, [1704, 2, 7, 337, 123, 1, 1]),  # 2,175 = round(43,500 / 20)
        (SHUTTLE_LIKE, 50, [681, 1, 2, 135, 49, 1, 1]),  # classes 1, 5, 6 below one: raised
        (SHUTTLE_LIKE, 10**6, [1, 1, 1, 1, 1, 1, 1]),  # a budget below the classes: one each
        ([1, 2], 1.01, [1, 2]),  # never more prototypes than rows
        ([1, 1000], 2, [1, 499]),  # the small class's one comes out of the total (500)
        ([347, 169, 109], 2.5, [139, 68, 43]),  # remainders 0.6 and 0.6 (exact): the lower
    ],
)
def test_the_budget_is_shared_by_size_and_a_small_class_keeps_one(counts, reduction, expected):
    y = np.repeat(np.arange(len(counts)), counts)
    budget = class_budget(y, reduction)
    assert list(budget.values()) == expected
    assert sum(expected) == max(len(counts), round(len(y) / reduction))
    assert all(1 <= m <= n for m, n in zip(expected, counts, strict=True))


@pytest.mark.parametrize(
    ("counts", "reduction", "floor", "expected"),
    [
        ([1000, 10, 2], 100, 1, [8, 1, 1]),  # total 10: the small classes keep one each
        ([1000, 10, 2], 100, 3, [5, 3, 2]),  # ... three each, or all of their rows
        ([5, 5, 5], 100, 3, [3, 3, 3]),  # the floors alone exceed round(15 / 100): 9 in all
        (SHUTTLE_LIKE, 50, 4, [673, 4, 4, 133, 48, 4, 4]),  # 870 in all: 1, 2, 5, 6 raised
        ([100, 30, 7], 10, 1, [10, 3, 1]),  # floor 1 is the rule without a floor
    ],
)
def test_a_floor_gives_every_class_that_many_prototypes_or_all_its_rows(
    counts, reduction, floor, expected
):
    y = np.repeat(np.arange(len(counts)), counts)
    budget = class_budget(y, reduction, floor)
    assert list(budget.values()) == expected
    floors = sum(min(floor, n) for n in counts)
    assert sum(expected) == max(floors, min(len(y), round(len(y) / reduction)))
    assert all(min(floor, n) <= m <= n for m, n in zip(expected, counts, strict=True))
    record = budget_record(y, reduction, floor=floor)
    if floor == 1:
        assert "floor" not in record and "raised_to_one" in record
    else:
        assert record["floor"] == floor and "raised_to_one" not in record
        assert record["raised_to_floor"] == [
            str(c) for c, n in enumerate(counts) if n * sum(expected) < floor * len(y)
        ]


def test_the_budget_record_counts_the_prototypes_made_when_editing_left_a_class_short():
    """Wilson editing removes 5 "dog" rows that sit among the cats; at 1.25 rows per
    prototype the budget (counted before editing) gives dog 16 prototypes, but only 15 dog
    rows remain and each starts one prototype: the record says 15, as the labels do."""
    from training.references.compress import compress

    rng = np.random.default_rng(0)
    x0, x1 = rng.normal(0, 1, (60, 2)), rng.normal(6, 1, (20, 2))
    x1[:5] = rng.normal(0, 0.3, (5, 2))
    x = np.vstack([x0, x1]).astype(np.float32)
    y = np.r_[np.zeros(60, int), np.ones(20, int)]
    result = compress(
        x,
        y,
        reduction=1.25,
        n_classes=2,
        rule="majority",
        edit_k=3,
        loss="f",
        max_iter=5,
        classes=["cat", "dog"],
    )
    assert result.editing["edited"]
    made = np.bincount(result.fit.labels, minlength=2)
    budget = result.budget
    assert budget["per_class"]["dog"] == {"rows": 20, "prototypes": int(made[1])}
    assert budget["per_class"]["cat"]["prototypes"] == int(made[0])
    assert budget["total"] == len(result.fit.labels)


def test_an_imbalanced_reference_set_compresses_and_says_which_classes_were_raised(tmp_path):
    """Classes of 5 and 12 rows beside ones of 125: at 5% and 2% kept every class keeps a
    prototype, the total is round(N / reduction), and the manifest's record, the lineage
    and the command's summary name the classes raised to one (the old rule refused)."""
    from tests.service.conftest import Split, build_model_artifact, digits_like_split

    split = digits_like_split()
    keep = np.ones(len(split.y_train), dtype=bool)
    for c, rows in ((3, 5), (7, 12)):
        keep[np.flatnonzero(split.y_train == c)[rows:]] = False
    small = Split(
        **{**split.__dict__, "X_train": split.X_train[keep], "y_train": split.y_train[keep]}
    )
    build_model_artifact(tmp_path / "imbalanced", small)
    n = int(keep.sum())  # 8 x 125 + 5 + 12 = 1,017 rows
    for reduction, refine in ((20, "nca"), (50, "nca"), (50, "none")):
        out = tmp_path / f"r{reduction}-{refine}"
        summary = condense_references(
            tmp_path / "imbalanced",
            out=out,
            method="prototypes",
            reduction=reduction,
            refine=refine,
            refine_epochs=5,
        )
        artifact = read_artifact(out)
        labels = np.asarray(artifact.labels)
        counts = np.bincount(labels, minlength=10)
        assert len(labels) == round(n / reduction) and (counts >= 1).all()
        assert counts[3] == 1 and counts[7] == 1
        budget = artifact.manifest["reference_set"]["budget"]
        assert budget["raised_to_one"] == ["3", "7"]
        assert budget["per_class"]["3"] == {"rows": 5, "prototypes": 1}
        assert budget["total"] == len(labels)
        assert artifact.manifest["lineage"][-1]["budget"] == budget == summary["budget"]
    # a floor of 3 at 5% kept: the two small classes keep three prototypes each (their
    # shares are 0.25 and 0.6), the big ones share the rest, the record says so
    out = tmp_path / "r20-floor3"
    summary = condense_references(
        tmp_path / "imbalanced",
        out=out,
        method="prototypes",
        reduction=20,
        refine_epochs=5,
        min_per_class=3,
    )
    counts = np.bincount(np.asarray(read_artifact(out).labels), minlength=10)
    assert counts[3] == 3 and counts[7] == 3 and counts.sum() == round(n / 20)
    budget = read_artifact(out).manifest["reference_set"]["budget"]
    assert budget["floor"] == 3 and budget["raised_to_floor"] == ["3", "7"]
    assert read_artifact(out).manifest["lineage"][-1]["settings"]["min_per_class"] == 3


def test_representatives_are_the_nearest_row_of_the_prototypes_class():
    u, y, _ = gaussian_classes(spread=3.0, seed=5)
    prototypes = np.array([[0.0, 0.0], [1.0, 1.0]], dtype=np.float32)
    labels = np.array([1, 3])
    rows = representatives(u, y, prototypes, labels)
    for row, p, c in zip(rows, prototypes, labels, strict=True):
        members = np.flatnonzero(y == c)
        assert row == members[((u[members] - p) ** 2).sum(1).argmin()]


# ---------------------------------------------------------------- the condense command


@pytest.fixture(scope="module")
def learned(digits_like_model, tmp_path_factory):
    """(parent path, learned path, summary): the digits-like model compressed 10x."""
    path, split = digits_like_model
    out = tmp_path_factory.mktemp("learned") / "m"
    summary = condense_references(
        path,
        out=out,
        method="prototypes",
        reduction=10,
        X_test=split.X_test,
        y_test=split.classes[split.y_test],
    )
    return path, out, summary


def test_condense_learns_prototypes_and_says_so(learned):
    path, out, summary = learned
    parent, child = read_artifact(path), read_artifact(out)
    sizes = np.bincount(np.asarray(parent.labels))
    assert len(child.ids) == round(sizes.sum() / 10) == summary["rows_after"]
    record = child.manifest["reference_set"]
    assert record["kind"] == "prototypes" and record["reduction"] == 10.0
    assert record["n_prototypes"] == len(child.ids)
    assert record["n_training_rows"] == len(parent.ids)
    # both losses were tried on validation and the record names the one kept
    assert record["losses_tried"].keys() == {"f", "log"}
    kept = max(("f", "log"), key=lambda loss: record["losses_tried"][loss])
    assert record["objective"] == f"NCA {kept} loss of the training rows against the prototypes"
    entry = child.manifest["lineage"][-1]
    assert entry["settings"]["refine"] == "nca" and entry["parent_version"] == parent.version
    # ids are real training rows of the prototype's own class
    label_of = dict(zip(parent.ids.tolist(), np.asarray(parent.labels).tolist(), strict=True))
    assert [label_of[i] for i in child.ids.tolist()] == np.asarray(child.labels).tolist()
    # the served k is the best on validation among the k values, and the calibration is redone
    assert child.default_k in (1, 3, 5, 7, 9, 11, 13, 15)
    assert child.manifest["outlier_calibration"] != parent.manifest["outlier_calibration"]
    after = summary["accuracy"]["test"]["after"]
    before = summary["accuracy"]["test"]["before"]
    assert after[str(child.default_k)] >= before[str(parent.default_k)] - 0.05


def test_the_compressed_model_serves_what_offline_evaluation_predicts(learned):
    _, out, _ = learned
    from tests.service.conftest import digits_like_split

    split = digits_like_split()
    artifact = read_artifact(out)
    model = load_model(out, settings_for(out))
    k = artifact.default_k
    query = resolve(model, model.n_references, k=k, rule=artifact.decision_rule)
    answer = infer_one(model, np.asarray(split.X_test, dtype=np.float32), query)
    z = project(split.X_test, artifact.projection, artifact.offset)
    offline = knn_predictions(
        artifact.embeddings,
        np.asarray(artifact.labels),
        z,
        len(artifact.classes),
        (k,),
        artifact.decision_rule,
    )[k]
    np.testing.assert_array_equal(np.asarray(answer.predicted), offline)
    with TestClient(create_app(settings_for(out))) as client:
        info = client.get("/v1/model").json()
        assert info["reference_set"]["kind"] == "prototypes"
        assert info["n_references"] == len(artifact.ids)
        body = {"instances": split.X_test[:20].tolist(), "return_neighbors": True}
        got = client.post("/v1/classify", json=body).json()["predictions"]
        assert [p["label"] for p in got] == [artifact.classes[c] for c in offline[:20]]
        assert all(n["id"] in set(artifact.ids.tolist()) for p in got for n in p["neighbors"])


def test_a_model_of_training_rows_says_so(digits_like_model):
    path, _ = digits_like_model
    with TestClient(create_app(settings_for(path))) as client:
        assert client.get("/v1/model").json()["reference_set"] == {"kind": "training_rows"}


def test_learning_prototypes_from_prototypes_is_refused_and_repeating_is_idempotent(
    learned, tmp_path
):
    _, out, _ = learned
    again = condense_references(out, out=tmp_path / "same", method="prototypes", reduction=10)
    assert read_artifact(tmp_path / "same").version == read_artifact(out).version
    assert again["rows_after"] == again["rows_before"]
    with pytest.raises(ReferenceError, match="already prototypes"):
        condense_references(out, out=tmp_path / "x", method="prototypes", reduction=2)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--reduction", "1"], "--reduction must be a number > 1"),
        (["--reduction", "0.5"], "--reduction must be a number > 1"),
        (["--reduction", "inf"], "--reduction must be a number > 1"),
        (["--reduction", "nan"], "--reduction must be a number > 1"),
        (["--refine-epochs", "-1"], "--refine-epochs must be an integer >= 0"),
    ],
)
def test_condense_cli_refuses_bad_budgets_with_exit_2_and_writes_nothing(
    digits_like_model, tmp_path, capsys, arguments, message
):
    path, _ = digits_like_model
    out = tmp_path / "never"
    base = ["references", "condense", "--model", str(path), "--method", "prototypes"]
    assert cli_main([*base, *arguments, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_class_without_references_is_refused(digits_like_model, tmp_path, capsys):
    path, _ = digits_like_model
    parent = read_artifact(path)
    gone = parent.ids[np.asarray(parent.labels) == 0]
    remove_references(path, gone, out=tmp_path / "no-zero")
    base = ["references", "condense", "--model", str(tmp_path / "no-zero")]
    arguments = [*base, "--method", "prototypes", "--reduction", "5", "--out", str(tmp_path / "x")]
    assert cli_main(arguments) == 2
    assert f"classes [{parent.classes[0]!r}] have no rows" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- the joint mode


def test_estimator_joint_mode_learns_prototypes_and_the_map():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    nca = NCA(n_components=8, max_iter=30, random_state=0, options=dict(prototypes=10))
    nca.fit(X[:1200], y[:1200], X_val=X[1200:1500], y_val=y[1200:1500])
    assert nca.prototypes_.shape == (sum(round(n / 10) for n in np.bincount(y[:1200])), 8)
    assert (y[:1200][nca.prototype_rows_] == nca.prototype_labels_).all()
    z = nca.transform(X[1500:])
    nearest = ((z[:, None] - nca.prototypes_[None]) ** 2).sum(-1).argmin(1)
    assert (nca.prototype_labels_[nearest] == y[1500:]).mean() > 0.85
    plain = NCA(n_components=8, max_iter=30, random_state=0).fit(X[:1200], y[:1200])
    assert plain.prototypes_ is None
    assert not np.allclose(plain.components_, nca.components_)  # the map moved with them
    # the same estimator refitted without prototypes keeps none of the joint fit's
    nca.set_params(options=None).fit(X[:1200], y[:1200])
    assert nca.prototypes_ is None and nca.prototype_fit_ is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1, "prototypes=1 must be None or a finite real number > 1"),
        (float("inf"), "prototypes=inf must be None or a finite real number > 1"),
    ],
)
def test_estimator_refuses_bad_prototype_budgets_before_fitting(value, message):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    with pytest.raises(ValueError, match=message):
        NCA(n_components=4, options=dict(prototypes=value)).fit(X[:600], y[:600])


def test_training_job_writes_a_prototype_artifact(tmp_path):
    from training.config import TrainConfig
    from training.job import run

    out = tmp_path / "joint"
    config = TrainConfig(
        data="digits",
        n_components=16,
        max_iter=30,
        quiet=True,
        plots=False,
        prototypes=10,
        out=str(out),
    )
    report = run(config, log=lambda message: None)
    artifact = read_artifact(out)
    record = artifact.manifest["reference_set"]
    assert record["kind"] == "prototypes" and "jointly" in record["method"]
    assert len(artifact.ids) == record["n_prototypes"] < record["n_training_rows"] / 5
    k = report["metrics"]["default_k"]
    assert artifact.default_k == k
    model = load_model(out, settings_for(out))
    from training.data.datasets import load_dataset, make_split

    split = make_split(load_dataset("digits"), test_size=0.2, val_size=0.1, seed=0)
    query = resolve(model, model.n_references, k=k, rule=artifact.decision_rule)
    answer = infer_one(model, np.asarray(split.X_test, dtype=np.float32), query)
    assert np.asarray(answer.predicted).tolist() == report["test_predictions"]["class_index"]
    # ids are training rows of the prototype's class
    assert (split.y_train[artifact.ids] == np.asarray(artifact.labels)).all()


def test_training_job_refuses_a_bad_prototype_budget_with_exit_2(tmp_path, capsys):
    from training.cli import main

    out = tmp_path / "never"
    assert main(["--data", "iris", "--prototypes", "0.5", "--out", str(out), "--quiet"]) == 2
    assert "--prototypes" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow  # a long real-server or training scenario: make test-slow
def test_noisy_labels_are_edited_before_the_prototypes_and_clean_ones_are_not():
    from training.references.compress import compress

    def noisy(y, seed):
        rng = np.random.default_rng(seed)
        flip = rng.random(len(y)) < 0.25
        y = y.copy()
        y[flip] = (y[flip] + rng.integers(1, 4, flip.sum())) % 4
        return y

    u_all, y_all, _ = gaussian_classes(n_per_class=500, spread=1.5, seed=8)
    order = np.random.default_rng(0).permutation(len(y_all))
    u, y = u_all[order[:1200]], y_all[order[:1200]]
    u_test, y_test = u_all[order[1600:]], y_all[order[1600:]]
    options = dict(reduction=10, n_classes=4, rule="majority", edit_k=5)
    plain = compress(u, noisy(y, 1), **{**options, "edit_k": 0})
    result = compress(u, noisy(y, 1), **options)
    assert result.editing["edited"] and result.editing["outvoted_rows"] > 0.15 * len(y)
    assert not plain.editing["edited"] and result.k == plain.k == 1  # no validation split
    # the budget is counted on the rows before editing
    assert len(result.fit.labels) == sum(class_budget(noisy(y, 1), 10).values())

    def accuracy(fit):
        nearest = ((u_test[:, None] - fit.prototypes[None]) ** 2).sum(-1).argmin(1)
        return (fit.labels[nearest] == y_test).mean()

    assert accuracy(result.fit) > accuracy(plain.fit) + 0.05
    clean = compress(u, y, **options)
    assert not clean.editing["edited"] and clean.editing["outvoted_rows"] < 0.05 * len(y)
