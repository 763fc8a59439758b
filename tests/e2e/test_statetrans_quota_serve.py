"""`justfit serve --sessions-max-bytes`: requests with distinct prompt_cache_key values and 24h retention
no longer grow the session store without bound; the least recently used sessions the server has closed
are evicted after a checkpoint, the ones it holds open stay."""

from pathlib import Path

import pytest

from tests.server_support import Served

from justfit.statetrans.manifest import list_manifests

openai = pytest.importorskip("openai")
KEYS = 20  # the server keeps its 16 most recent sessions open: 4 are closed and can go


@pytest.mark.slow  # ~1 min (20 requests); tests/unit/test_statetrans_walls.py checks the option's wiring and the eviction
def test_session_quota_evicts_closed_least_recently_used_sessions(default_model_dir, tmp_path):
    s = Served(tmp_path, str(default_model_dir), "--sessions-max-bytes", "1MB")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)
        for i in range(KEYS):
            r = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": f"Client {i}: say a number."}],
                max_tokens=1, temperature=0, extra_body={"prompt_cache_key": f"k{i}", "prompt_cache_retention": "24h"})
            assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        s.stop()
    names = {m.name for m in list_manifests(Path(tmp_path))}
    # (before: all 20 stayed, the store growing with every key)
    assert f"k{KEYS - 1}" in names and "k0" not in names and len(names) <= 16, sorted(names)
