"""Our GGUF reader (`gguf_fields`) reads what `gguf.GGUFReader`, the maintained library, reads:
every key with its value and type (every value type, arrays of strings and of arrays included),
every tensor's entry and data, the data section's alignment; a truncated or corrupt file is a
GGUFError. The tokenizer built from those fields saves the very files `AutoTokenizer` saves
from the GGUF file itself. Tiny files written by `gguf.GGUFWriter` run in the fast lane, the
real models (SmolLM2-135M-Instruct, Gemma-3-270M) in the slow one."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from transformers import AutoTokenizer

from splitserve.engine import gguf_tokenizer
from splitserve.engine.gguf_fields import read_gguf
from splitserve.engine.gguf_loader import GGUFError, GGUFModel
from splitserve.engine.gguf_tokenizer import tokenizer_from_fields, write_tokenizer
from splitserve.launch.named_models import NAMED_MODELS
from splitserve.testing.gguf_checkpoint import hf_to_gguf, random_blocks
from splitserve.testing.gguf_gemma3 import write_tiny_gemma3_gguf
from splitserve.testing.tiny_model import make_tiny_model

# key -> (value, type, element type): one of each value type, and arrays of each
VALUES = {
    "t.u8": (200, V.UINT8, None), "t.i8": (-100, V.INT8, None),
    "t.u16": (60_000, V.UINT16, None), "t.i16": (-30_000, V.INT16, None),
    "t.u32": (4_000_000_000, V.UINT32, None), "t.i32": (-2_000_000_000, V.INT32, None),
    "t.u64": (2**63 + 5, V.UINT64, None), "t.i64": (-(2**62), V.INT64, None),
    "t.f32": (0.1, V.FLOAT32, None), "t.f64": (0.1, V.FLOAT64, None),
    "t.true": (True, V.BOOL, None), "t.false": (False, V.BOOL, None),
    "t.str": ("héllo 日本語 🎉\n", V.STRING, None), "t.empty_str": ("", V.STRING, None),
    "t.a_u8": ([0, 255, 7], V.ARRAY, V.UINT8), "t.a_i8": ([-128, 127], V.ARRAY, V.INT8),
    "t.a_u16": ([65_535, 1], V.ARRAY, V.UINT16), "t.a_i16": ([-5, 5], V.ARRAY, V.INT16),
    "t.a_u32": ([1, 2**32 - 1], V.ARRAY, V.UINT32), "t.a_i32": ([-1, 3], V.ARRAY, V.INT32),
    "t.a_u64": ([2**64 - 1], V.ARRAY, V.UINT64), "t.a_i64": ([-(2**63), 9], V.ARRAY, V.INT64),
    "t.a_f32": ([0.5, -1e-30, 3.4e38], V.ARRAY, V.FLOAT32),
    "t.a_f64": ([1e-300, -2.5], V.ARRAY, V.FLOAT64),
    "t.a_bool": ([True, False, True], V.ARRAY, V.BOOL),
    "t.a_str": (["a", "", "ü", "  ", "<0x0A>", "▁hello"], V.ARRAY, V.STRING),
    "t.a_nested": ([[1, 2], [3], [4, 5, 6]], V.ARRAY, V.ARRAY),
    "t.a_nested_str": ([["a", "bc"], ["日本"]], V.ARRAY, V.ARRAY),
}  # fmt: skip


def _write(path: Path, alignment: int | None = None) -> Path:
    """A GGUF file holding every value type and tensors of several kinds."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, kind, element) in VALUES.items():
        writer.add_key_value(key, value, kind, sub_type=element)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.normal(size=(3, 4, 32)).astype(np.float32))
    writer.add_tensor("f16", rng.normal(size=(64,)).astype(np.float16))
    writer.add_tensor("i32", np.arange(96, dtype=np.int32).reshape(3, 32))
    q8 = gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), Q.Q8_0)
    writer.add_tensor("q8_0", q8, raw_dtype=Q.Q8_0)
    writer.add_tensor("q4_k", random_blocks("Q4_K", 2, 512).data, raw_dtype=Q.Q4_K)
    bf16 = rng.integers(0, 256, (2, 64), dtype=np.uint8)  # 32 values a row, as bytes
    writer.add_tensor("bf16", bf16, raw_dtype=Q.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _flat(value):
    """What `GGUFReader.contents()` gives for an array of arrays: its leaves, in order."""
    if isinstance(value, list):
        return [leaf for item in value for leaf in (_flat(item) if isinstance(item, list)
                                                    else [item])]  # fmt: skip
    return value


def _same_as_ggufs_reader(path: Path) -> None:
    ours, reader = read_gguf(path), gguf.GGUFReader(str(path))
    theirs = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(theirs)  # the file's order
    assert ours.version == reader.fields["GGUF.version"].contents()
    for key, field in theirs.items():
        assert _flat(ours.fields[key]) == field.contents(), key
        assert ours.types[key] == tuple(field.types[: len(ours.types[key])]), key
        if field.types[0] != V.ARRAY:
            assert type(ours.fields[key]) is type(field.contents()), key
    assert (ours.alignment, ours.data_offset) == (reader.alignment, reader.data_offset)
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, their in zip(ours.tensors, reader.tensors, strict=True):
        assert mine.tensor_type == their.tensor_type, mine.name
        assert mine.dims == tuple(their.shape.tolist()), mine.name
        assert (mine.offset, mine.num_bytes) == (their.data_offset, their.n_bytes), mine.name
        data = ours.tensor_data(mine)
        assert (data.dtype, data.shape) == (their.data.dtype, their.data.shape), mine.name
        np.testing.assert_array_equal(data, their.data, err_msg=mine.name)


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_reads_as_ggufs_reader_reads_it(tmp_path, alignment):
    path = _write(tmp_path / "all.gguf", alignment)
    _same_as_ggufs_reader(path)
    header = read_gguf(path)
    assert header.alignment == (alignment or 32) and header.data_offset % header.alignment == 0
    for key, (value, kind, element) in VALUES.items():  # NOTE: arrays of arrays stay nested
        if V.FLOAT32 in (kind, element):
            value = np.asarray(value, dtype=np.float32).tolist()  # what a float32 holds
        assert header.fields[key] == value, key
        assert header.types[key] == ((kind,) if element is None else (kind, element)), key


def test_a_tiny_models_file_reads_as_ggufs_reader_reads_it(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", "qwen3")
    _same_as_ggufs_reader(hf_to_gguf(hf, tmp_path / "tiny.gguf", "Q8_0"))
    _same_as_ggufs_reader(write_tiny_gemma3_gguf(tmp_path / "gemma3.gguf"))


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + payload


def _header(*kvs: bytes, version: int = 3, tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, len(kvs)) + b"".join(kvs)


ARCH = _kv("general.architecture", V.STRING, struct.pack("<Q", 5) + b"llama")


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty"),
        (b"not a gguf file at all", "no GGUF magic"),
        (_header(ARCH, version=1), "version 1 is not supported"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
        (_header(ARCH, ARCH), "appears twice"),
        (_header(ARCH, _kv("x", 99, b"")), "unknown metadata value type 99"),
        (_header(_kv("x", V.STRING, struct.pack("<Q", 2**40) + b"ab")), "past the end"),
        (_header(_kv("x", V.ARRAY, struct.pack("<IQ", V.UINT32, 2**40))), "past the end"),
        (
            _header(_kv("x", V.ARRAY, struct.pack("<IQQQ", V.STRING, 2, 0, 5) + b"ab")),
            "past the end",
        ),
        (_header(_kv("general.alignment", V.UINT32, struct.pack("<I", 48))), "power of two"),
        (_header(_kv("general.alignment", V.UINT64, struct.pack("<Q", 64))), "not a u32"),
        (_header(_kv("x", V.STRING, struct.pack("<Q", 2) + b"\xff\xfe")), "utf-8"),
        (_header(ARCH, tensors=1), "ends early"),
    ],
)
def test_a_corrupt_file_is_a_gguf_error_saying_why(tmp_path, content, reason):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match="is not a readable GGUF file") as error:
        GGUFModel.open(path)
    assert reason in str(error.value)


def test_a_file_cut_anywhere_is_a_gguf_error(tmp_path):
    whole = _write(tmp_path / "whole.gguf").read_bytes()
    header = read_gguf(tmp_path / "whole.gguf")
    data_end = max(t.offset + t.num_bytes for t in header.tensors)
    # in the key/values, in the tensor table, in the last tensor's data
    for end in (3, 20, 40, 200, 1000, header.data_offset - 9, data_end - 1):
        cut = tmp_path / f"cut{end}.gguf"
        cut.write_bytes(whole[:end])
        with pytest.raises(GGUFError, match="is not a readable GGUF file"):
            read_gguf(cut)


def test_a_tensor_of_a_type_unknown_to_gguf_is_a_gguf_error(tmp_path):
    whole = bytearray(_write(tmp_path / "whole.gguf").read_bytes())
    n_dims_at = whole.index(b"q4_k") + 4  # its entry: name, n_dims, dims, type, offset
    type_at = n_dims_at + 4 + 8 * struct.unpack_from("<I", whole, n_dims_at)[0]
    assert struct.unpack_from("<I", whole, type_at)[0] == Q.Q4_K
    struct.pack_into("<I", whole, type_at, 1234)
    (tmp_path / "odd.gguf").write_bytes(bytes(whole))
    with pytest.raises(GGUFError, match="'q4_k' has unknown type id 1234"):
        read_gguf(tmp_path / "odd.gguf")


# ---- the tokenizer: the files AutoTokenizer saves ---------------------------------------------


def _saved(tokenizer, folder: Path) -> dict[str, bytes]:
    tokenizer.save_pretrained(str(folder))
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _autotokenizer_files(gguf_path: Path, folder: Path) -> dict[str, bytes]:
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    return _saved(tokenizer, folder)


def _written_files(gguf_path: Path, folder: Path) -> dict[str, bytes]:
    model = GGUFModel.open(gguf_path)
    folder.mkdir()
    write_tokenizer(model.header, model.hf_config["model_type"], folder)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    """One GGUF file (alone in its folder) per tokenizer kind: byte-level BPE (`gpt2`) as
    Llama and Qwen 2/3 files hold it, Gemma's SentencePiece vocabulary (`llama`)."""
    root = tmp_path_factory.mktemp("tokenizer-ggufs")
    files = {}
    for arch, overrides in {"llama": {"rope_scaling": None}, "qwen2": {}, "qwen3": {}}.items():
        hf = make_tiny_model(root / f"hf-{arch}", arch, config_overrides=overrides)
        (root / arch).mkdir()
        files[arch] = hf_to_gguf(hf, root / arch / f"tiny-{arch}.gguf")
    (root / "gemma3").mkdir()
    files["gemma3"] = write_tiny_gemma3_gguf(root / "gemma3" / "tiny-gemma3.gguf")
    return files


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_the_tokenizer_from_our_fields_saves_autotokenizers_files(
    tiny_ggufs, tmp_path, monkeypatch, arch
):
    path = tiny_ggufs[arch]
    model = GGUFModel.open(path)
    built = tokenizer_from_fields(model.header, model.hf_config["model_type"])
    if built is None:
        pytest.skip("this transformers has no GGUF tokenizer pieces to build from our fields")
    theirs = _autotokenizer_files(path, tmp_path / "theirs")
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(theirs)
    assert _saved(built, tmp_path / "ours") == theirs

    def no_second_read(*args, **kwargs):
        raise AssertionError("the conversion read the GGUF file through AutoTokenizer")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_second_read)
    assert _written_files(path, tmp_path / "written") == theirs


def test_without_transformers_pieces_autotokenizer_builds_it(tiny_ggufs, tmp_path, monkeypatch):
    path = tiny_ggufs["gemma3"]
    theirs = _autotokenizer_files(path, tmp_path / "theirs")
    monkeypatch.setattr(gguf_tokenizer, "tokenizer_from_fields", lambda *args: None)
    assert _written_files(path, tmp_path / "written") == theirs


def test_tokenizer_files_beside_the_gguf_are_read_as_transformers_reads_them(tiny_ggufs, tmp_path):
    alone = _autotokenizer_files(tiny_ggufs["qwen2"], tmp_path / "alone")
    folder = tmp_path / "with-tokenizer-json"
    folder.mkdir()
    path = folder / "tiny.gguf"
    path.write_bytes(tiny_ggufs["qwen2"].read_bytes())
    gemma3 = _autotokenizer_files(tiny_ggufs["gemma3"], tmp_path / "gemma3")
    (folder / "tokenizer.json").write_bytes(gemma3["tokenizer.json"])  # another vocabulary
    theirs = _autotokenizer_files(path, tmp_path / "theirs")
    assert theirs != alone  # NOTE: transformers takes the folder's tokenizer.json over the file
    assert _written_files(path, tmp_path / "written") == theirs


# ---- the real models: slow lane ---------------------------------------------------------------


@pytest.mark.slow
def test_the_real_files_read_as_ggufs_reader_reads_them(smollm2, gemma3):
    _same_as_ggufs_reader(next(smollm2.gguf_dir.glob("*.gguf")))
    gemma3_file = gemma3.gguf_dir / NAMED_MODELS["gemma-3-270m"].gguf
    _same_as_ggufs_reader(gemma3_file)
    assert len(read_gguf(gemma3_file).fields["tokenizer.ggml.tokens"]) == 262_144


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_real_models_converted_tokenizer_is_autotokenizers(request, tmp_path, name):
    model = request.getfixturevalue(name)
    (path,) = model.gguf_dir.glob("*.gguf")
    theirs = _autotokenizer_files(path, tmp_path / "theirs")
    ours = {f: (model.hf_dir / f).read_bytes() for f in theirs}  # what resolve_checkpoint wrote
    assert ours == theirs
