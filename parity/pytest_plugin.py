"""pytest plugin (entry point `parity`): the `parity_check` fixture.

The fixture is `assert_parity` itself; being a fixture it needs no import in the test
file and shows up in `pytest --fixtures`.  Loading the plugin imports nothing heavy.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def parity_check():
    """assert_parity(model, target=..., layers=...): fails the test with parity's table when a layer deviates.

    One test per layer, so each passes or fails on its own::

        @pytest.mark.parametrize("layer", range(12))
        def test_ffn_layer(parity_check, layer):
            parity_check("gpt2", target="mymodel:mlp", layers=[layer])
    """
    from parity.testing import assert_parity

    return assert_parity
