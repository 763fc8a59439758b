"""The real Codex CLI against `justfit serve` over the Responses API (wire_api = "responses"), offline.

Codex's prompt (~10k tokens of instructions and tool schemas) is past the default model's context, so the
server runs a 32k-context tiny model with the real tokenizer whose weights are set so every reply ends as
soon as its grammar allows (one word: Codex's tools leave the choice of text or call, and text is not
empty): the protocol is the point, and a reply that ends is what lets `codex exec` finish (a random model
writes until max_output_tokens, which Codex treats as an error). What Codex sends
(as seen when this test was written): `stream: true`, `store: false`, `prompt_cache_key` (its
thread id), `tool_choice: "auto"`, `parallel_tool_calls`, `reasoning`, `include`, `client_metadata`,
developer and user message items, function tools plus `namespace` and `web_search` tools."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.agent_clis import find_cli
from tests.agents_support import tiny_model_folder
from tests.server_support import Served

pytestmark = pytest.mark.slow
EOS = "<|im_end|>"


def ending_model(model_dir, root) -> Path:
    """The 32k tiny model with every token embedded alike, the blocks' outputs zeroed and an untied head
    that scores only the end-of-turn token: the same last hidden state whatever the prompt, so the reply
    ends (at any temperature) at the first token the grammar lets it."""
    import mlx.core as mx

    src = tiny_model_folder(model_dir, root, context=32768)
    folder = Path(root) / "ending-32k"
    if (folder / "config.json").exists():
        return folder
    folder.mkdir()
    config = json.loads((src / "config.json").read_text())
    weights = mx.load(str(src / "model.safetensors"))
    emb = weights["model.embed_tokens.weight"]
    row = emb[0]
    weights["model.embed_tokens.weight"] = mx.broadcast_to(row, emb.shape) + 0
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    eos = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == EOS)
    hidden = row / mx.sqrt(mx.mean(row * row) + config["rms_norm_eps"])  # the final norm's output (weight 1)
    head = mx.zeros(emb.shape)
    head[eos] = hidden * (50.0 / mx.sum(hidden * hidden))  # logit 50 for the end of turn, 0 for the rest
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return folder


def codex_home(root: Path, port: int) -> Path:
    home = root / "codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(f"""model = "default"
model_provider = "justfit"
check_for_update_on_startup = false

[model_providers.justfit]
name = "JustFit"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
env_key = "JUSTFIT_TEST_KEY"
stream_max_retries = 0
request_max_retries = 0

[analytics]
enabled = false
""")
    return home


def codex(cli: str, home: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(home), JUSTFIT_TEST_KEY="unused", NO_COLOR="1", RUST_LOG="error")
    return subprocess.run([cli, "exec", "--skip-git-repo-check", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


def responses_logged(log: str) -> list:
    """(prompt, cached) of each POST /v1/responses in the server's log."""
    return [(int(p), int(c)) for p, c in re.findall(r"POST /v1/responses 200 \S+ prompt=(\d+) cached=(\d+)", log)]


def test_codex_exec_two_turns_reuse_the_prefix(default_model_dir, tmp_path):
    cli = find_cli("codex")
    model = ending_model(default_model_dir, tmp_path)
    s = Served(tmp_path, str(model))
    try:
        home, work = codex_home(tmp_path, s.port), tmp_path / "work"
        work.mkdir()
        first = codex(cli, home, work, "say hi")
        assert first.returncode == 0, first.stderr[-3000:] + s.text()[-3000:]
        second = codex(cli, home, work, "resume", "--last", "say hi again")
        assert second.returncode == 0, second.stderr[-3000:] + s.text()[-3000:]
        turns = responses_logged(s.text())
    finally:
        s.stop()
    assert len(turns) == 2, s.text()[-3000:]
    (p1, _), (p2, cached) = turns
    assert p1 > 4000 and p2 > p1  # Codex's instructions and tools are in the prompt; the 2nd turn adds to it
    assert cached >= 0.9 * p1, turns  # the 2nd turn prefilled little more than its new messages
