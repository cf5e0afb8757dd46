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


def test_every_file_of_a_saved_artifact_has_one_mode(tmp_path):
    """Weights were 0600 (safetensors' writer) beside 0644 manifests (issue 51, item 11): every
    file of a checkpoint and of a KVQuant state now follows the umask, as single files did."""
    import copy

    import torch

    import palu
    from palu.calib.kvquant import fit_kvquant
    from tiny import tiny_llama
    old = os.umask(0o022)
    try:
        base = tiny_llama(0)
        calib = torch.randint(1, 97, (2, 16), generator=torch.Generator().manual_seed(0))
        palu.compress(copy.deepcopy(base), calib, kept_ratio=0.5, group_size=2, progress=False).save(tmp_path / "ckpt")
        fit_kvquant(copy.deepcopy(base), calib, bits=3, weighting="uniform", tokens_per_window=16,
                    progress=False).save(tmp_path / "state")
        files = [p for p in tmp_path.rglob("*") if p.is_file()]
        assert {p.name for p in files} >= {"factors.safetensors", "state.safetensors", "manifest.json"}
        assert {p.name: _mode(p) for p in files} == {p.name: 0o644 for p in files}
    finally:
        os.umask(old)
