"""Two eagle2 processes at once, or one killed midway: the kernel build's lock, the
cache that two first runs fill together, temporaries a killed run leaves behind."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from eagle2_core import atomic, native

ROOT = Path(__file__).resolve().parents[1]

# A process that takes eagle2's build lock, leaves torch's `lock` file as a build in progress
# does, and then either is killed (argv[3] == "hang") or finishes the build (argv[3] == "finish").
BUILDER = textwrap.dedent("""
    import importlib.util, os, sys, time
    from pathlib import Path
    # native.py alone, by its path: the package would import torch (seconds)
    spec = importlib.util.spec_from_file_location("native", sys.argv[1])
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    folder = Path(sys.argv[2])
    with native._one_builder(folder):
        (folder / "lock").write_text("")
        print("building", flush=True)
        if sys.argv[3] == "hang":
            time.sleep(120)
        time.sleep(1.0)
        (folder / (folder.name + ".so")).write_text("built")
        (folder / "lock").unlink()
""")


def stand_in_load(calls: list):
    """torch's `load` as far as its lock goes: a `lock` in the build folder means another build
    is running and it would wait (here: fail at once instead of hanging the suite)."""
    def load(name, sources, build_directory, **kw):
        folder = Path(build_directory)
        if (folder / "lock").exists():
            raise AssertionError("would wait forever on torch's lock")
        calls.append(name)
        (folder / f"{name}.so").write_text("built")
        return f"module {name}"
    return load


def start_builder(folder: Path, mode: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", BUILDER, native.__file__, str(folder), mode], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "building"
    return p


@pytest.fixture
def fresh_build_root(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_STATE", {})
    calls: list = []
    import torch.utils.cpp_extension as ext

    monkeypatch.setattr(ext, "load", stand_in_load(calls))
    name = f"eagle2_native_{native.cpu_digest()}_0"
    return native.build_dir(name), calls


def test_a_build_killed_midway_does_not_block_the_next_run(fresh_build_root):
    """kill -9 during the build leaves torch's lock file; the next run builds again, saying so once."""
    folder, calls = fresh_build_root
    p = start_builder(folder, "hang")
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert (folder / "lock").exists()  # what a killed build leaves
    with pytest.warns(UserWarning, match="stopped midway") as said:
        assert native.module() == f"module {folder.name}"
    assert len(said) == 1 and calls == [folder.name] and not (folder / "lock").exists()


def test_a_live_build_is_waited_for_not_taken_over(fresh_build_root):
    """While another process builds, its lock is not stale: the second run waits for it, then
    finds the build (no warning, torch's lock never removed under a live builder)."""
    folder, calls = fresh_build_root
    p = start_builder(folder, "finish")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.module() == f"module {folder.name}"
    assert p.wait() == 0 and (folder / f"{folder.name}.so").read_text() == "built"
    assert calls == [folder.name]  # our load ran only after the builder had released everything


def test_is_built_looks_where_the_build_goes(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = f"eagle2_native_{native.cpu_digest()}_1"
    assert native.build_dir(name) == tmp_path / name  # torch's own layout under TORCH_EXTENSIONS_DIR
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert native.build_dir(name).parent.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}")


# -- the cache two first runs fill at once ---------------------------------------------------
# A GGUF's config and tokenizer, parsed from its metadata, are what its first load keeps (never its
# weights); each process writes its own folder, and both reach the writing at the same moment.
CONVERT = textwrap.dedent("""
    import os, sys, time
    from eagle2_core import ggufload, loading
    path, ready = sys.argv[1], sys.argv[2]
    real = ggufload._write_meta
    def write(where, parsed, tok):
        open(os.path.join(ready, str(os.getpid())), "w").close()
        end = time.time() + 60
        while len(os.listdir(ready)) < 2 and time.time() < end:
            time.sleep(0.02)
        return real(where, parsed, tok)
    ggufload._write_meta = write
    folder, name = os.path.split(path)
    config, parsed, tok = ggufload.read_metadata(folder, name, loading.cache_dir())
    print(ggufload.meta_folder(folder, name, loading.cache_dir()))
""")


def test_two_first_runs_fill_one_empty_cache(tmp_path):
    """Two first loads of one GGUF into one empty cache folder, writing at the same moment: both
    succeed, the cache holds one whole copy of the metadata, and no temporary is left."""
    from test_gguf_load import write_tiny_gguf

    cache, ready = tmp_path / "cache", tmp_path / "ready"
    ready.mkdir()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(str(path), "llama", {}, tied=True, hidden=64)
    env = dict(os.environ, EAGLE2_CACHE=str(cache), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT, str(path), str(ready)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert len(os.listdir(ready)) == 2  # they did write at once
    folders = os.listdir(cache / "gguf-meta")
    assert len(folders) == 1 and folders[0].startswith("tiny-"), folders  # one copy, no temporaries
    assert {o[0].strip() for o in outs} == {str(cache / "gguf-meta" / folders[0])}

    from transformers import AutoConfig, AutoTokenizer

    whole = cache / "gguf-meta" / folders[0]
    AutoTokenizer.from_pretrained(whole)
    AutoConfig.from_pretrained(whole)
    assert not [f for f in os.listdir(whole) if f.endswith((".safetensors", ".bin"))]


def test_temporaries_of_killed_writers_are_cleaned_and_live_ones_kept(tmp_path):
    final = tmp_path / "profile.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = atomic._host()
    gone = tmp_path / f"profile.json.tmp-{host}-{dead.pid}-abcd1234"
    gone.mkdir()
    (gone / "model.safetensors").write_bytes(b"half")
    mine = Path(atomic.temp_sibling(str(final)))
    mine.write_text("being written")
    legacy_old, legacy_new = tmp_path / "profile.json.tmp", tmp_path / "other.json.tmp"
    legacy_old.write_text("x")
    os.utime(legacy_old, (time.time() - 2 * atomic.STALE_S, time.time() - 2 * atomic.STALE_S))
    legacy_new.write_text("y")
    elsewhere = tmp_path / "profile.json.tmp-otherhost-1-abcd1234"  # another host's writer: only by age
    elsewhere.write_text("z")
    assert atomic.clean_stale(str(final)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, legacy_new.name, elsewhere.name])


def test_a_file_written_by_two_at_once_is_whole(tmp_path):
    """The cost profile's writer: each write goes through its own temporary, the last one wins whole."""
    path = tmp_path / "p.json"
    code = ("import sys; sys.path.insert(0, sys.argv[3]); import importlib.util as u; "
            "s = u.spec_from_file_location('atomic', sys.argv[1]); a = u.module_from_spec(s); s.loader.exec_module(a)\n"
            "for i in range(200): a.write_text(sys.argv[2], sys.argv[4] * 50000)")
    procs = [subprocess.Popen([sys.executable, "-c", code, atomic.__file__, str(path), str(ROOT), ch]) for ch in "ab"]
    assert [p.wait() for p in procs] == [0, 0]
    assert path.read_text() in ("a" * 50000, "b" * 50000) and os.listdir(tmp_path) == ["p.json"]


def test_publish_dir_second_writer_finds_the_first(tmp_path):
    final = tmp_path / "model"
    for content in ("first", "second"):
        tmp = Path(atomic.temp_sibling(str(final)))
        tmp.mkdir()
        (tmp / "f").write_text(content)
        atomic.publish_dir(str(tmp), str(final))
    assert (final / "f").read_text() == "first" and os.listdir(tmp_path) == ["model"]


def test_native_module_loads_alone():
    """native.py is imported by path in the builder script above: it must need no package import."""
    spec = importlib.util.spec_from_file_location("native_alone", native.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert callable(mod._one_builder)
