"""pytest plugin (entry point `parity`): the `parity_check` fixture, the `--parity-require-real` option,
and a short summary line for parity's failures.

The fixture is `assert_parity` itself; being a fixture it needs no import in the test
file and shows up in `pytest --fixtures`.  Loading the plugin imports nothing heavy
(``parity.errors`` imports nothing).
"""

from __future__ import annotations

import pytest

from parity.errors import ParityAssertionError, ParityError

# Set from the command line at configure time; parity.testing reads it (with PARITY_REQUIRE_REAL).
REQUIRE_REAL = {"on": False}


def pytest_addoption(parser):
    parser.getgroup("parity").addoption(
        "--parity-require-real", action="store_true", default=False,
        help="fail (instead of skip) every assert_parity / parity_check test that has only synthetic weights "
             "(also: PARITY_REQUIRE_REAL=1)")


def pytest_configure(config):
    REQUIRE_REAL["on"] = bool(config.getoption("parity_require_real", default=False))


def pytest_unconfigure(config):
    REQUIRE_REAL["on"] = False  # an in-process pytest run (pytester) must not leave its option to the outer one


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """pytest's short summary shows 'ExceptionClass: message' cut at the terminal's width; for parity's own
    exceptions it shows the first line alone (model, layer, diagnosis id) and a short class name."""
    outcome = yield
    report = outcome.get_result()
    error = call.excinfo.value if call.excinfo is not None else None
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if isinstance(error, (ParityAssertionError, ParityError)) and crash is not None:
        first = getattr(error, "short", None) or str(error).split("\n", 1)[0].removeprefix("parity: ")
        if not isinstance(error, ParityAssertionError):
            first = f"{type(error).__name__}: {first}"
        try:
            crash.message = first
        except AttributeError:  # a frozen representation in some pytest version: keep pytest's own line
            pass


@pytest.fixture
def parity_check():
    """assert_parity(model, target=..., layers=...): fails the test with parity's table when a layer deviates,
    skips it when only synthetic weights are available (``--parity-require-real`` fails it instead).

    One test per layer, so each passes or fails on its own::

        @pytest.mark.parametrize("layer", range(12))
        def test_ffn_layer(parity_check, layer):
            parity_check("gpt2", target="mymodel:mlp", layers=[layer])
    """
    from parity.testing import assert_parity

    return assert_parity
