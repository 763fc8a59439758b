"""The pure-Python GGUF header reader: what it reads, and the one-line errors for files we cannot load."""

import numpy as np
import pytest

from justfit.errors import UserError
from justfit.models.gguf_reader import SkippedArray, check_supported, read_header
from tests.gguf_writer import smollm_gguf_path, write_tiny_llama_gguf

SUPPORTED = ["F32", "F16", "Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One tiny Q4_0 GGUF shared by the error tests, which copy or cut it."""
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q4_0")


def _one_line_error(path, match):
    with pytest.raises(UserError, match=match) as e:
        check_supported(path)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("tensor_type", SUPPORTED)
def test_header_matches_gguf_py(tensor_type, tmp_path):
    """Names, row-major shapes, types and offsets agree with the gguf package's own reader."""
    import gguf

    g = write_tiny_llama_gguf(tmp_path / "m.gguf", tensor_type, embed_type="Q8_0")
    header = check_supported(g.path)
    assert header.version == 3 and header.architecture == "llama"
    assert header.metadata["llama.block_count"] == 2
    assert header.metadata["llama.attention.head_count_kv"] == 2
    ref = gguf.GGUFReader(g.path)
    assert [t.name for t in header.tensors] == [t.name for t in ref.tensors]
    for ours, theirs in zip(header.tensors, ref.tensors):
        assert ours.shape == tuple(int(d) for d in reversed(theirs.shape))
        assert ours.type_name == theirs.tensor_type.name
        assert header.data_offset + ours.offset == theirs.data_offset
        assert ours.nbytes == theirs.n_bytes
    types = {t.name: t.type_name for t in header.tensors}
    assert types["blk.1.ffn_down.weight"] == tensor_type
    assert types["token_embd.weight"] == "Q8_0"
    assert types["output_norm.weight"] == "F32"
    assert header.tensors[0].shape == (len(g.tokens), 64)


def test_big_arrays_skipped_unless_asked(tiny):
    header = read_header(tiny.path)
    skipped = header.metadata["tokenizer.ggml.tokens"]
    assert isinstance(skipped, SkippedArray) and skipped.length == len(tiny.tokens)
    full = read_header(tiny.path, array_limit=None)
    assert full.metadata["tokenizer.ggml.tokens"] == tiny.tokens
    assert full.metadata["tokenizer.ggml.token_type"][:3] == [3, 3, 3]


def test_real_smollm2_header():
    try:
        path = smollm_gguf_path()
    except RuntimeError as e:
        pytest.skip(f"real SmolLM2 GGUF unavailable: {e}")
    header = check_supported(path)
    assert len(header.tensors) == 272
    counts = {}
    for t in header.tensors:
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    assert counts == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    last = max(header.tensors, key=lambda t: t.offset)
    assert header.data_offset + last.offset + last.nbytes == header.file_size
    assert header.metadata["llama.embedding_length"] == 576


def test_reference_weights_match_mlx_dequantization(tmp_path):
    """The writer's float reference (HF layout) equals MLX's reading of the file after undoing the q/k
    rope permutation, so converter tests can trust it."""
    import mlx.core as mx

    g = write_tiny_llama_gguf(tmp_path / "m.gguf", "Q4_1", seed=3)
    w = mx.load(str(g.path))
    heads, kv_heads, half = 4, 2, 8

    def dequant(name):
        return np.array(mx.dequantize(w[name + ".weight"], w[name + ".scales"], w[name + ".biases"], 32, 4))

    def unpermute(x, n):
        return x.reshape(n, half, 2, -1).swapaxes(1, 2).reshape(x.shape)

    q = unpermute(dequant("blk.1.attn_q"), heads)
    k = unpermute(dequant("blk.1.attn_k"), kv_heads)
    np.testing.assert_allclose(q, g.weights["model.layers.1.self_attn.q_proj.weight"], atol=5e-4)
    np.testing.assert_allclose(k, g.weights["model.layers.1.self_attn.k_proj.weight"], atol=5e-4)
    np.testing.assert_allclose(dequant("blk.0.ffn_down"), g.weights["model.layers.0.mlp.down_proj.weight"], atol=5e-4)
    assert np.abs(q - dequant("blk.1.attn_q")).max() > 1e-2  # the permutation is really there


def test_missing_file(tmp_path):
    msg = _one_line_error(tmp_path / "nope.gguf", "no such file")
    assert "nope.gguf" in msg


def test_directory_is_not_a_gguf(tmp_path):
    _one_line_error(tmp_path, "not a file")


def test_bad_magic(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 10)
    _one_line_error(bad, "not a GGUF file")


def test_empty_file(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _one_line_error(empty, "not a GGUF file")


def test_unsupported_version(tiny, tmp_path):
    data = bytearray(tiny.path.read_bytes())
    data[4:8] = (7).to_bytes(4, "little")
    bad = tmp_path / "v7.gguf"
    bad.write_bytes(bytes(data))
    _one_line_error(bad, "version 7")


@pytest.mark.parametrize("keep", [10, 30, 2000])
def test_truncated_header(tiny, tmp_path, keep):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.path.read_bytes()[:keep])
    _one_line_error(cut, "truncated")


def test_truncated_tensor_data(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.path.read_bytes()[:-100])
    msg = _one_line_error(cut, "truncated")
    assert "output_norm.weight" in msg  # the last tensor is the one that runs past the end
    read_header(tiny.path)  # the uncut file is fine


@pytest.mark.parametrize("bad_type", ["Q5_0", "Q4_K"])
def test_unsupported_tensor_type(tmp_path, bad_type):
    size = 256 if bad_type == "Q4_K" else 64  # K-quants need rows of 256 values
    g = write_tiny_llama_gguf(tmp_path / "m.gguf", bad_type, embed_type="Q8_0", hidden=size, ffn=size)
    msg = _one_line_error(g.path, f"unsupported GGUF tensor type {bad_type}")
    assert "blk.0." in msg  # names the tensor


@pytest.mark.parametrize("arch", ["falcon", "qwen2"])
def test_unsupported_architecture(tmp_path, arch):
    g = write_tiny_llama_gguf(tmp_path / "m.gguf", "Q8_0", architecture=arch)
    _one_line_error(g.path, f"unsupported GGUF architecture '{arch}'")


def test_mistral_architecture_accepted(tmp_path):
    g = write_tiny_llama_gguf(tmp_path / "m.gguf", "Q8_0", architecture="mistral")
    assert check_supported(g.path).architecture == "mistral"
