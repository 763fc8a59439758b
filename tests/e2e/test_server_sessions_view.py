"""The web page's session endpoints (`/justfit/sessions`): a persisted `prompt_cache_key` conversation is
listed, read back and deleted."""


def _chat(http, key: str, content: str) -> dict:
    body = {"model": "default", "max_tokens": 3, "temperature": 0, "prompt_cache_key": key,
            "prompt_cache_retention": "24h", "messages": [{"role": "user", "content": content}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_session_is_listed_read_and_deleted(server):
    http = server.http
    first = _chat(http, "view-me", "Name one planet.")

    rows = {r["name"]: r for r in http.get("/justfit/sessions").json()["sessions"]}
    assert "view-me" in rows and rows["view-me"]["tokens"] >= first["usage"]["prompt_tokens"], rows

    one = http.get("/justfit/sessions/view-me").json()
    assert one["name"] == "view-me" and one["tokens"] == rows["view-me"]["tokens"] and one["text"], one

    r = http.delete("/justfit/sessions/view-me")
    assert r.status_code == 200 and r.json() == {"name": "view-me", "deleted": True}, r.text
    assert "view-me" not in {r["name"] for r in http.get("/justfit/sessions").json()["sessions"]}
    assert http.get("/justfit/sessions/view-me").status_code == 404
    assert http.delete("/justfit/sessions/view-me").status_code == 404


def test_a_bad_session_name_is_a_400_not_a_500(server):
    r = server.http.get("/justfit/sessions/..%2Fetc")
    assert r.status_code in (400, 404), r.text
