"""Hub ids resolved through huggingface_hub's local cache with HF_HUB_OFFLINE=1."""

import pytest

from parity.errors import OfflineError
from parity.sources.hub import hub_reachable


@pytest.fixture(autouse=True)
def _fresh_reachability():
    hub_reachable.cache_clear()
    yield
    hub_reachable.cache_clear()


def test_hub_id_from_offline_cache(hf_cache):
    import parity

    report = parity.check("tiny-org/gpt2")
    assert report.passed and report.checkpoint == "tiny-org/gpt2" and report.weights == "real"
    assert parity.check("tiny-org/llama", layers=[1]).passed


def test_mapping_name_with_cached_checkpoint(hf_cache):
    import parity

    report = parity.check("llama", checkpoint="tiny-org/llama", layers=[0])
    assert report.passed and report.mapping == "llama"


def test_offline_uncached_hub_id_says_how_to_fix(hf_cache):
    import parity

    with pytest.raises(OfflineError, match="HF_HUB_OFFLINE"):
        parity.check("tiny-org/missing")


def test_unknown_revision_offline(hf_cache):
    import parity

    with pytest.raises(OfflineError):
        parity.check("tiny-org/gpt2", revision="v9")
