"""Result files are written atomically and readable like any other file the user writes: the
umask decides their mode, not the temporary file's 0600 (issue 34, item 6)."""
import os
import stat

from palu.artifacts import atomic_dir, write_json, write_text


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_files_and_folders_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "r.json", {"ppl": 1.5})
        write_text(tmp_path / "t.md", "x")
        with atomic_dir(tmp_path / "ckpt", "f") as d:
            (d / "f").write_text("y")
        assert _mode(tmp_path / "r.json") == 0o644 and _mode(tmp_path / "t.md") == 0o644
        assert _mode(tmp_path / "ckpt") == 0o755
        os.umask(0o077)
        write_json(tmp_path / "private.json", {"a": 1})
        assert _mode(tmp_path / "private.json") == 0o600
    finally:
        os.umask(old)
