"""Several models under one memory budget in `justfit serve`: the default model and a tiny random-weight
llama, under a budget that cannot hold both, served from one app (pool.py)."""

import json
import shutil

import pytest

import justfit

PROMPT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="session")
def tiny_model(default_model_dir, tmp_path_factory):
    """A 2-layer llama with random weights and the default model's tokenizer (about 55 MB in float32)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    config = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 2048, "vocab_size": 49152,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(config))
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    return folder


def _weights(rt) -> int:
    return sum(c.size() for c in rt.phaseswap.components.values() if c.kind != "kv")


@pytest.fixture(scope="module")
def pooled(default_model_dir, tiny_model, tmp_path_factory):
    """The default model first and the tiny one, under a budget that holds either with room for short
    prompts' KV but not both (the tiny model's weights are more than the room left beside the default's)."""
    from tests.server_support import InProcess
    from justfit.server.pool import estimate_weights

    kv = justfit.KVConfig(bits=4, format="affine")
    home = tmp_path_factory.mktemp("pool-home")
    probe = justfit.Runtime(model=str(default_model_dir), kv=kv, home=home)
    budget = _weights(probe) + estimate_weights(str(tiny_model)) * 3 // 4
    del probe
    rt = justfit.Runtime(model=str(default_model_dir), kv=kv, home=home, memory_budget=budget)
    s = InProcess(rt, models=(("tiny", str(tiny_model)),), memory_budget=budget)
    s.budget = budget
    yield s
    s.stop()


def _chat(srv, model, messages=PROMPT, **extra):
    r = srv.http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 6,
                                                    "temperature": 0, **extra})
    return r


def _resident(srv):
    return [m["name"].split(":")[0] for m in srv.http.get("/api/ps").json()["models"]]


def test_alternating_models_share_one_budget(pooled, server):
    reference = _chat(server, "default").json()["choices"][0]["message"]["content"]
    listed = {m["id"] for m in pooled.http.get("/v1/models").json()["data"]}
    assert "tiny-llama" in listed and len(listed) == 2
    tags = {m["name"] for m in pooled.http.get("/api/tags").json()["models"]}
    assert "tiny-llama:latest" in tags
    tiny_replies = []
    for _ in range(2):
        r = _chat(pooled, "default")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == reference  # same greedy reply as one model alone
        assert _resident(pooled) == [r.json()["model"]]
        r = _chat(pooled, "tiny-llama")
        assert r.status_code == 200, r.text
        tiny_replies.append(r.json()["choices"][0]["message"]["content"])
        assert _resident(pooled) == ["tiny-llama"]  # the default model was unloaded to make room
    assert tiny_replies[0] == tiny_replies[1]
    metrics = pooled.http.get("/metrics").text  # gauges per loaded model, labelled with its id
    assert 'justfit_model_batch_steps_total{model="tiny-llama"}' in metrics, metrics
    assert 'justfit_resident_bytes{model="tiny-llama",' in metrics and 'model="SmolLM2' not in metrics
    assert "\njustfit_queue_length 0\n" in metrics
    report = pooled.http.get("/justfit/models").json()
    assert report["resident_bytes"] <= pooled.budget
    loads = [e for e in report["events"] if e.startswith("load ")]
    unloads = [e for e in report["events"] if e.startswith("unload ")]
    assert len(loads) >= 3 and len(unloads) >= 3  # every switch released one and loaded the other
    row = next(m for m in report["models"] if m["id"] == "tiny-llama")
    assert row["loaded"] and row["bytes"]["weights"] > 0


def test_session_of_an_evicted_model_restores_its_kv(pooled):
    first = PROMPT
    r = _chat(pooled, "default", first, prompt_cache_key="pool-s1", prompt_cache_retention="24h")
    assert r.status_code == 200, r.text
    reply, n_first = r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens"]
    assert _chat(pooled, "tiny-llama").status_code == 200  # evicts the default model and its session
    assert "default" not in " ".join(_resident(pooled)) and len(_resident(pooled)) == 1
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another one."}]
    r = _chat(pooled, "default", second, prompt_cache_key="pool-s1", prompt_cache_retention="24h")
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= n_first  # restored from disk: only the new tokens were prefilled


def test_request_over_the_budget_is_503(pooled):
    words = " ".join(["colour"] * 6000)
    r = _chat(pooled, "default", [{"role": "user", "content": words}])
    assert r.status_code == 503, r.text
    assert r.headers.get("retry-after")
    assert r.json()["error"]["code"] == "memory_budget"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "default", "prompt": "WORDS", "max_tokens": 4, "stream": True}),
    ("/v1/responses", {"model": "default", "input": "WORDS", "max_output_tokens": 16, "stream": True}),
    ("/v1/messages", {"model": "default", "max_tokens": 4, "stream": True,
                      "messages": [{"role": "user", "content": "WORDS"}]}),
    ("/api/chat", {"model": "default", "messages": [{"role": "user", "content": "WORDS"}]}),
    ("/api/generate", {"model": "default", "prompt": "WORDS"}),
])
def test_every_api_refuses_a_prompt_over_the_budget_before_it_streams(pooled, path, body):
    """Each API reserves the prompt's KV and prefill workspace at admission, as chat does: a status line of
    503 with retry-after, not a stream that fails after its first event."""
    words = " ".join(["colour"] * 6000)
    r = pooled.http.post(path, content=json.dumps(body).replace("WORDS", words),
                         headers={"content-type": "application/json"})
    assert r.status_code == 503, r.text[:300]
    assert r.headers.get("retry-after")
    assert "memory budget" in r.text


def test_unload_and_load_endpoints(pooled):
    r = pooled.http.post("/api/generate", json={"model": "tiny-llama", "prompt": "", "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    assert "tiny-llama" not in _resident(pooled)
    # showing a model reads its folder: it does not load it (a client listing every model evicts nothing)
    shown = pooled.http.post("/api/show", json={"model": "tiny-llama"}).json()
    assert shown["model_info"]["llama.context_length"] == 2048 and "{%" in shown["template"], shown
    assert "tiny-llama" not in _resident(pooled)
    with pooled.http.stream("POST", "/justfit/models/tiny-llama/load") as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["status"] == "ready", events
    assert "tiny-llama" in _resident(pooled)
    r = pooled.http.post("/justfit/models/tiny-llama/unload")
    assert r.json() == {"model": "tiny-llama", "unloaded": True}
    assert pooled.http.post("/justfit/models/nope/unload").status_code == 404


def test_ollama_load_duration_is_the_load_a_request_waited_for(pooled):
    pooled.http.post("/api/generate", json={"model": "tiny-llama", "prompt": "", "keep_alive": 0})
    body = {"model": "tiny-llama", "prompt": "Hi", "stream": False, "options": {"num_predict": 2, "temperature": 0}}
    first = pooled.http.post("/api/generate", json=body).json()
    assert first["load_duration"] > 1e6 and first["total_duration"] > first["load_duration"], first  # loaded for it
    again = pooled.http.post("/api/generate", json=body).json()
    assert again["load_duration"] < first["load_duration"] / 10, again  # resident already


@pytest.fixture(scope="module")
def drafted(default_model_dir, tiny_model, tmp_path_factory):
    """The default model served with the tiny llama as its draft model (`justfit serve --draft-model`),
    and a --models-dir holding a tiny GGUF and a file that only claims to be one."""
    from gguf_writer import write_tiny_llama_gguf
    from tests.server_support import InProcess
    from justfit.models import scan_models_dir

    kv = justfit.KVConfig(bits=4, format="affine")
    home = tmp_path_factory.mktemp("draft-home")
    folder = tmp_path_factory.mktemp("models-dir")
    write_tiny_llama_gguf(folder / "tiny-gguf.gguf", "Q8_0")
    (folder / "broken.gguf").write_bytes(b"GGUF" + bytes(60))
    rt = justfit.Runtime(model=str(default_model_dir), kv=kv, home=home, draft_model=str(tiny_model))
    s = InProcess(rt, draft_model=str(tiny_model), models=tuple(scan_models_dir(folder)))
    yield s
    s.stop()


def _row(srv, model_id):
    return next(m for m in srv.http.get("/justfit/models").json()["models"] if m["id"] == model_id)


def test_a_draft_model_is_a_part_of_its_target_under_the_budget(drafted, server, tiny_model):
    """The draft model's bytes count in its target's weights and in the server's resident bytes; it drafts
    for a lone greedy request without changing the reply, and an unload and reload brings it back."""
    from justfit.server.pool import estimate_weights

    ask = [{"role": "user", "content": "Count from one to ten in words."}]
    reference = _chat(server, "default", ask, max_tokens=24).json()["choices"][0]["message"]["content"]
    r = _chat(drafted, "default", ask, max_tokens=24)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == reference  # drafting leaves greedy output alone
    model_id = r.json()["model"]
    row = _row(drafted, model_id)
    draft = row["draft"]
    assert draft is not None and draft["draft_passes"] > 0 and draft["drafted_tokens"] > 0, row
    assert abs(draft["bytes"] - estimate_weights(str(tiny_model))) < 0.1 * draft["bytes"], row
    assert row["bytes"]["weights"] > draft["bytes"] * 2  # the target's own weights beside it
    assert drafted.http.get("/justfit/models").json()["resident_bytes"] >= row["bytes"]["weights"]
    assert drafted.http.post(f"/justfit/models/{model_id}/unload").json()["unloaded"] is True
    r = _chat(drafted, "default", ask, max_tokens=24)
    assert r.json()["choices"][0]["message"]["content"] == reference
    row = _row(drafted, model_id)
    assert row["loads"] == 1 and row["draft"]["bytes"] == draft["bytes"], row  # reloaded with its drafter


def test_a_gguf_in_a_models_dir_is_served_by_name_and_converted_on_first_use(drafted):
    listed = {m["id"] for m in drafted.http.get("/v1/models").json()["data"]}
    assert {"tiny-gguf", "broken"} <= listed, listed
    with drafted.http.stream("POST", "/justfit/models/tiny-gguf/load") as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    statuses = [e["status"] for e in events]
    assert statuses[0] == "converting" and statuses[-1] == "ready", events
    r = _chat(drafted, "tiny-gguf")
    assert r.status_code == 200 and r.json()["model"] == "tiny-gguf", r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    # a file that is no GGUF: a clear error for the request, and the server goes on serving
    r = _chat(drafted, "broken")
    assert r.status_code == 500 and r.json()["error"]["code"] == "model_load_failed", r.text
    assert "broken" in r.json()["error"]["message"]
    with drafted.http.stream("POST", "/justfit/models/broken/load") as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["status"] == "error" and events[-1]["code"] == "model_load_failed", events
    assert _chat(drafted, "tiny-gguf").status_code == 200
