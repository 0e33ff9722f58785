"""The fault matrix (`tests/test_fault_matrix.py`) on a requests session: the same rows, the same expected
outcomes, the same checks after them (server-side counts, the pool, a follow-up, every socket closed).

requests is blocking, so its rows run as the sync flavour does, with a plain `requests.Session` or one with a mounted
`llama_guard.requests.GuardAdapter` (`tests/_requests_driver.py` maps the httpx error names the rows expect to
requests' classes). Plain requests fails every plain row as plain httpx does, so no row is changed here.
"""

from __future__ import annotations

import pytest

from .test_fault_matrix import ROWS, Case, frozen_heap, run_case

__all__ = ["frozen_heap"]  # the matrix's module fixture, autouse here too


@pytest.mark.parametrize("case", ROWS, ids=[case.id for case in ROWS])
def test_fault_requests(case: Case) -> None:
    run_case(case, "sync", "requests")
