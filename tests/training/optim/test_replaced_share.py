"""How far a refresh moved the neighbourhoods (training.optim.problem.replaced_share): the
share of candidate entries not among a row's previous candidates, on exact toy tables."""

from __future__ import annotations

import pytest
import torch

from training.optim import problem
from training.optim.problem import replaced_share


def test_new_entries_are_counted_whatever_their_order():
    old = torch.tensor([[1, 2, 3], [4, 5, 6]])
    new = torch.tensor([[1, 2, 7], [6, 5, 4]])  # one new entry; the second row reordered
    assert replaced_share(old, new) == pytest.approx(1 / 6)


def test_tables_of_other_widths_after_k_changed():
    old = torch.tensor([[1, 2], [3, 4]])
    new = torch.tensor([[1, 2, 9], [7, 8, 9]])  # 1 of 3, then 3 of 3 new
    assert replaced_share(old, new) == pytest.approx(4 / 6)


def test_padding_matches_padding_and_a_first_refresh_replaces_everything():
    old = torch.tensor([[1, -1], [2, -1]])
    assert replaced_share(old, torch.tensor([[1, -1], [3, -1]])) == pytest.approx(1 / 4)
    assert replaced_share(None, old) == 1.0
    assert replaced_share(old, old.clone()) == 0.0


def test_blocks_of_rows_give_the_same_share(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    old = torch.randint(0, 50, (37, 6), generator=generator)
    new = torch.randint(0, 50, (37, 6), generator=generator)
    whole = replaced_share(old, new)
    monkeypatch.setattr(problem, "REPLACED_BLOCK_ROWS", 5)
    assert replaced_share(old, new) == whole
    # against a count by Python sets
    fresh = sum(len(set(n.tolist()) - set(o.tolist())) for o, n in zip(old, new, strict=True))
    duplicates = sum(len(n) - len(set(n.tolist())) for n in new)  # repeated new entries
    assert fresh <= whole * new.numel() <= fresh + duplicates
