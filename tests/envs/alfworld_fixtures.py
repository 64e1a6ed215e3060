"""Fixtures shared by the ALFWorld test modules (imported by name into each)."""
from __future__ import annotations

import pytest

GEN = "alfworld-generated"


@pytest.fixture(scope="module", autouse=True)
def alfworld_data(tmp_path_factory):
    """alfworld creates $ALFWORLD_DATA on import: keep it (and the official-data lookup) in a temp folder."""
    folder = tmp_path_factory.mktemp("alfworld_data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALFWORLD_DATA", str(folder))
        yield folder


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("alfworld_generated"))
