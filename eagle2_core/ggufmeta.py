"""A GGUF file's metadata read once, in plain Python, and handed to transformers' own conversions.

transformers reads a GGUF's config through gguf-py's GGUFReader, which makes a numpy view of
every string of the token and merge arrays (seconds for a 50k vocabulary, half a minute for
Gemma's 262k), and its tokenizer through a reader of its own that walks the file again, twice.
Here the header is parsed once with `struct` over the file's bytes, and, while `served` is
active, those readers are answered from that parse: GGUFReader by an object with the attributes
transformers reads of it (`fields` with `parts`, `data` and `types`; `tensors` with `name`), and
transformers' `read_gguf_metadata` by the same dict and names it returns. transformers' own code
then builds the config and the tokenizer as it always does, from the same values. A file this
parse does not take as ordinary (not little-endian version 2 or 3, a nested array, a repeated
key, a cut header) is left to the real readers, errors and all.
"""
from __future__ import annotations

import mmap
import os
import struct
from collections import OrderedDict
from types import SimpleNamespace

# GGUF's fixed-size value types: id -> struct format (the formats transformers' reader uses)
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_WIDTHS = {t: struct.calcsize("<" + f) for t, f in _FORMATS.items()}
_NUMPY = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
          10: "uint64", 11: "int64", 12: "float64"}
_STRING, _ARRAY = 8, 9
# what transformers' `_gguf_parse_value` makes of a fixed-size value of each type
_CONVERT = {**{t: int for t in (0, 1, 2, 3, 4, 5, 10, 11)}, 6: float, 12: float, 7: bool}


class Unusual(Exception):
    """The file is not one this parse reads: the real readers take it."""


class Metadata:
    """A GGUF's metadata in file order: `values` {key: (type, value)}, where a string is its raw
    bytes, an array is (element type, [values]) with strings as raw bytes; `tensor_names`."""

    def __init__(self, path: str, version: int, values: dict, raw: dict, tensor_names: tuple[str, ...]):
        self.path = path
        self.version = version
        self.values = values
        self.raw = raw  # a fixed-size scalar's bytes as the file holds them
        self.tensor_names = tensor_names
        self._reader = None

    def metadata(self, string_arrays=()) -> dict:
        """What transformers' `read_gguf_metadata(path, string_arrays)` gives as its dict: scalars
        as Python values, strings decoded, arrays of fixed-size values as lists, arrays of strings
        as decoded lists where named in `string_arrays` and as their length elsewhere."""
        out = {}
        for key, (vtype, value) in self.values.items():
            if vtype == _STRING:
                value = value.decode("utf-8")
            elif vtype == _ARRAY:
                etype, items = value
                if etype == _STRING:
                    value = [s.decode("utf-8") for s in items] if key in string_arrays else len(items)
                else:
                    value = list(items)
            out[key] = value
        return out

    def reader(self):
        """A stand-in for gguf-py's GGUFReader as transformers' `load_gguf_checkpoint` reads it."""
        if self._reader is None:
            self._reader = _reader_of(self)
        return self._reader


def _reader_of(meta: Metadata):
    """GGUFReader's fields as it lays them out: a scalar's parts [key length, key bytes, type,
    value] with data [3]; a string's [.., type, length, bytes] with data [4]; an array's [..,
    type, element type, count] then each element's parts (a string: length and bytes), data
    pointing at each element's value, types [9, element type] ([9] where empty). Values that
    `_gguf_parse_value` reads one at a time (array elements) are bytes and 1-tuples, which it
    reads to the same values as gguf-py's numpy views; the rest are numpy arrays as gguf-py's."""
    import numpy as np

    def head(key: str, vtype: int) -> list:
        kb = key.encode("utf-8")
        return [np.array([len(kb)], np.uint64), np.frombuffer(kb, np.uint8), np.array([vtype], np.uint32)]

    fields = OrderedDict()
    fields["GGUF.version"] = SimpleNamespace(name="GGUF.version", parts=[np.array([meta.version], np.uint32)],
                                             data=[0], types=[4])
    fields["GGUF.tensor_count"] = SimpleNamespace(name="GGUF.tensor_count", data=[0], types=[10],
                                                  parts=[np.array([len(meta.tensor_names)], np.uint64)])
    fields["GGUF.kv_count"] = SimpleNamespace(name="GGUF.kv_count", data=[0], types=[10],
                                              parts=[np.array([len(meta.values)], np.uint64)])
    for key, (vtype, value) in meta.values.items():
        parts = head(key, vtype)
        if vtype == _STRING:
            parts += [np.array([len(value)], np.uint64), value]
            data, types = [4], [_STRING]
        elif vtype == _ARRAY:
            etype, items = value
            n = len(items)
            parts += [np.array([etype], np.uint32), np.array([n], np.uint64)]
            types = [_ARRAY, etype] if n else [_ARRAY]
            if etype == _STRING:
                pairs = [None] * (2 * n)
                pairs[0::2] = [(len(s),) for s in items]
                pairs[1::2] = items
                parts += pairs
                data = list(range(6, 6 + 2 * n, 2))
            else:
                parts += [(v,) for v in items]
                data = list(range(5, 5 + n))
        else:
            parts.append(np.frombuffer(meta.raw[key], _NUMPY[vtype]).copy())
            data, types = [3], [vtype]
        fields[key] = SimpleNamespace(name=key, parts=parts, data=data, types=types)
    tensors = [SimpleNamespace(name=name) for name in meta.tensor_names]
    return SimpleNamespace(fields=fields, tensors=tensors)


def parse(path: str) -> Metadata:
    """The file's metadata and tensor names (Unusual where this parse does not take the file)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise Unusual("too short")
            # mapped rather than read, as the header's length is known only once parsed: only its
            # pages are touched, and they are unmapped on the way out (the values are copies)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf)
    except (struct.error, IndexError, ValueError, OSError, OverflowError, MemoryError) as e:
        raise Unusual(str(e)) from None


def _parse(path: str, buf) -> Metadata:
    unpack = struct.unpack_from
    end = len(buf)
    if buf[:4] != b"GGUF":
        raise Unusual("no GGUF magic")
    version, n_tensors, n_kv = unpack("<IQQ", buf, 4)
    if version not in (2, 3):  # also a file of the other byte order, which reads as a huge version
        raise Unusual(f"version {version}")
    pos = 24

    def text_bytes(at: int) -> tuple[bytes, int]:
        (n,) = unpack("<Q", buf, at)
        at += 8
        if at + n > end:
            raise Unusual("a string runs past the end of the file")
        return buf[at: at + n], at + n

    values, raw = {}, {}
    for _ in range(n_kv):
        kb, pos = text_bytes(pos)
        key = kb.decode("utf-8")
        if key in values or key.startswith("GGUF."):
            raise Unusual(f"key {key} is repeated or GGUFReader's own")
        (vtype,) = unpack("<I", buf, pos)
        pos += 4
        if vtype in _FORMATS:
            (value,) = unpack("<" + _FORMATS[vtype], buf, pos)
            raw[key] = buf[pos: pos + _WIDTHS[vtype]]
            pos += _WIDTHS[vtype]
        elif vtype == _STRING:
            value, pos = text_bytes(pos)
        elif vtype == _ARRAY:
            etype, count = unpack("<IQ", buf, pos)
            pos += 12
            if etype in _FORMATS:
                if pos + count * _WIDTHS[etype] > end:
                    raise Unusual("an array runs past the end of the file")
                items = unpack(f"<{count}{_FORMATS[etype]}", buf, pos)
                pos += count * _WIDTHS[etype]
            elif etype == _STRING:
                items = []
                append = items.append
                for _ in range(count):
                    (n,) = unpack("<Q", buf, pos)
                    pos += 8
                    append(buf[pos: pos + n])
                    pos += n
                if pos > end:
                    raise Unusual("an array runs past the end of the file")
            else:
                raise Unusual(f"an array of type {etype}")
            value = (etype, items)
        else:
            raise Unusual(f"value type {vtype}")
        values[key] = (vtype, value)
    if values.get("general.architecture", (None,))[0] != _STRING:
        raise Unusual("no general.architecture string")
    alignment = 32
    if "general.alignment" in values:  # GGUFReader takes only a u32 power of two
        vtype, alignment = values["general.alignment"]
        if vtype != 4 or alignment == 0 or alignment & (alignment - 1):
            raise Unusual("an alignment GGUFReader refuses")
    table = []
    for _ in range(n_tensors):
        nb, pos = text_bytes(pos)
        (n_dims,) = unpack("<I", buf, pos)
        dims = unpack(f"<{n_dims}Q", buf, pos + 4)
        pos += 4 + 8 * n_dims
        qtype, offset = unpack("<IQ", buf, pos)
        pos += 12
        table.append((nb.decode("utf-8"), dims, qtype, offset))
    names = tuple(name for name, *_ in table)
    if len(set(names)) != len(names):
        raise Unusual("a tensor name is repeated")
    _check_tensors(table, -(-pos // alignment) * alignment, end)
    return Metadata(path, version, values, raw, names)


def _check_tensors(table, data_start: int, end: int) -> None:
    """GGUFReader makes a view of every tensor's data, and fails on a file whose tensors it cannot
    (a type it does not know, a row not whole blocks, data past the end): such a file is its."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, dims, qtype, offset in table:
        try:
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise Unusual(f"tensor {name} is of type {qtype}") from None
        n = 1
        for d in dims:
            n *= d
        if (block > 1 and dims and dims[0] % block) or data_start + offset + n * nbytes // block > end:
            raise Unusual(f"tensor {name} is not whole in the file")


class served:
    """Inside the block, gguf-py's GGUFReader and transformers' `read_gguf_metadata` answer for the
    file `meta` was parsed from out of `meta` (other files still go to the real readers), and
    transformers reads the stand-in reader's array elements in one step each. The names are
    swapped module-wide, as a load reads its metadata on one thread."""

    def __init__(self, meta: Metadata):
        self.meta = meta

    def _same(self, path) -> bool:
        try:
            return os.path.samefile(os.fspath(path), self.meta.path)
        except (OSError, TypeError):
            return False

    def __enter__(self):
        import gguf
        import transformers.integrations.gguf as hf_gguf
        import transformers.integrations.gguf.reader as hf_reader

        meta, same = self.meta, self._same
        real_reader, real_read = gguf.GGUFReader, hf_reader.read_gguf_metadata

        def reader(path, *args, **kwargs):
            if not args and not kwargs and same(path):
                return meta.reader()
            return real_reader(path, *args, **kwargs)

        def read_gguf_metadata(gguf_path, string_arrays=()):
            if same(gguf_path):
                return meta.metadata(string_arrays), meta.tensor_names
            return real_read(gguf_path, string_arrays)

        import transformers.modeling_gguf_pytorch_utils as hf_utils

        real_load, loaded = hf_utils.load_gguf_checkpoint, []

        def load_gguf_checkpoint(path, return_tensors=False, **kwargs):
            # the config and then the tokenizer ask for the same metadata: converted once (each
            # element of the vocabulary and merges goes through a Python call), copied to each
            if return_tensors or kwargs or not same(path):
                return real_load(path, return_tensors, **kwargs)
            if not loaded:
                loaded.append(real_load(path, False))
            return _copied(loaded[0])

        real_parse = hf_utils._gguf_parse_value

        def parse_value(value, data_type):
            # An array element of the stand-in reader (_reader_of), read to what transformers'
            # reading gives, in one step rather than its two calls and a list per element: a
            # string's bytes decoded, a number's 1-tuple converted. Anything else: transformers'.
            if type(data_type) is list and len(data_type) == 2 and data_type[0] == _ARRAY:
                kind = data_type[1]
                if kind == _STRING and type(value) is bytes:
                    return value.decode()
                if type(value) is tuple and kind in _CONVERT:
                    return _CONVERT[kind](value[0])
            return real_parse(value, data_type)

        self.saved = [(gguf, "GGUFReader", real_reader), (hf_reader, "read_gguf_metadata", real_read),
                      (hf_gguf, "read_gguf_metadata", real_read), (hf_utils, "load_gguf_checkpoint", real_load),
                      (hf_utils, "_gguf_parse_value", real_parse)]
        hf_utils.load_gguf_checkpoint = load_gguf_checkpoint
        hf_utils._gguf_parse_value = parse_value
        gguf.GGUFReader = reader
        hf_reader.read_gguf_metadata = read_gguf_metadata
        hf_gguf.read_gguf_metadata = read_gguf_metadata  # the lazy package's name, as tokenization_auto imports it
        return self

    def __exit__(self, *exc):
        for module, name, value in self.saved:
            setattr(module, name, value)
        return False


def _copied(value):
    """A copy of nested dicts and lists of plain values (what load_gguf_checkpoint returns), each
    container new, as copy.deepcopy makes it in a fraction of its time (no memo, no dispatch)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value] if any(isinstance(v, (dict, list)) for v in value) else list(value)
    return value
