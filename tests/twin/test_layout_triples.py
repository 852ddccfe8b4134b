"""The layout matrix at strength three: rows that, with ``test_layout_matrix``'s, hold every
combination of values of every three axes, for the vLLM this process imports.

Pairwise rows missed a fault that needs three values at once (Mamba's speculative scratch
blocks move only with prefix caching on and drafts): the full product found it. Every
triple is the trim that covers such a fault by construction, where dropping an axis would
not: 64 combinations of one vLLM become the rows below plus the pairwise ones. Each row
asserts what ``test_layout_matrix`` asserts of its own (``check_row``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.twin.exactness import covered, covering
from tests.twin.test_layout_matrix import AXES, ROWS, THIS_VLLM, check_row, row_id

pytestmark = pytest.mark.twin

LAYOUT_AXES = {n: v for n, v in AXES.items() if n != "vllm"}
PAIRWISE = [r for r in ROWS if r["vllm"] == THIS_VLLM]
TRIPLE_ROWS = [r | {"vllm": THIS_VLLM} for r in covering(LAYOUT_AXES, 3, PAIRWISE)]


def test_rows_cover_every_triple_with_the_pairwise_ones() -> None:
    names = list(LAYOUT_AXES)
    product_rows = covering(LAYOUT_AXES, 5)  # strength = every axis: the whole product
    assert len(product_rows) == 64
    every_triple = set().union(*(covered(r, 3) for r in product_rows))
    have = set().union(*(covered({n: r[n] for n in names}, 3) for r in PAIRWISE + TRIPLE_ROWS))
    assert have == every_triple
    assert not [r for r in TRIPLE_ROWS if r in PAIRWISE]  # no row runs twice


@pytest.mark.parametrize("row", TRIPLE_ROWS, ids=row_id)
def test_ledger_equals_pool_every_step(row: dict[str, Any]) -> None:
    check_row(row)
