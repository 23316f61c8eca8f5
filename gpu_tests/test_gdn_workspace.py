"""A Gated DeltaNet layer's prefill chunk stays within the GDN term of the plan's prefill workspace on the GPU
(the term the 4gb and 8gb plans are sized by), at the plans' chunk lengths."""

import pytest

from tools.gpu.gdn_prefill import measure


@pytest.mark.parametrize("tokens", [1024, 2048, 1000])
def test_the_chunk_peak_is_within_the_planned_workspace(tokens):
    figures = measure(tokens, repeat=1)
    assert 0 < figures["peak_bytes"] <= figures["budget_bytes"], figures
