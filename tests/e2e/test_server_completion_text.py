"""Text completions continue their prompt: the first generated token keeps its leading space, streamed
or not, with and without `echo` (a chat reply starts a message, so there the space is dropped)."""

import json




def test_completion_keeps_the_first_tokens_space(server):
    body = {"model": "default", "prompt": "Once upon a", "max_tokens": 4, "temperature": 0}
    text = server.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert text.startswith(" "), repr(text)
    echoed = server.http.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "Once upon a" + text, repr(echoed)
    with server.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        pieces = [json.loads(line[6:])["choices"] for line in r.iter_lines()
                  if line.startswith("data: {")]
    streamed = "".join(c[0]["text"] for c in pieces if c)
    assert streamed == text, (streamed, text)
