"""Bundles cut into parts for a GPU host whose transfers are capped (workflow/gpu_parts.py):
what arrives is what left, part by part and whole, and nothing lands outside the root."""
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow"))
import gpu_parts  # noqa: E402


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "checkout"
    (root / "work" / "wheelhouse").mkdir(parents=True)
    (root / "work" / "wheelhouse" / "a.whl").write_bytes(bytes(range(256)) * 300)
    (root / "work" / "journal").mkdir()
    (root / "work" / "journal" / "j.jsonl").write_text("{}\n" * 1000)
    return root


def test_split_stage_join_gives_back_every_file(src, tmp_path):
    out = tmp_path / "parts"
    m = gpu_parts.split(out, ["work/wheelhouse", "work/journal"], part_mib=0.02, root=src)
    assert len(m["parts"]) > 3 and all(p["bytes"] <= 0.02 * 2**20 for p in m["parts"])
    staged, host = tmp_path / "stage", tmp_path / "host"
    host.mkdir()
    for k in reversed(range(len(m["parts"]))):      # any order
        gpu_parts.stage(out / f"p{k}", staged)
    gpu_parts.join(staged, host)
    assert _tree(host) == _tree(src)
    gpu_parts.join(staged, host)                    # again: the same files are kept, no error
    assert not (staged / "bundle.tar.tmp").exists()


def test_a_bad_part_a_missing_part_or_other_content_is_refused(src, tmp_path):
    out = tmp_path / "parts"
    m = gpu_parts.split(out, ["work"], part_mib=0.02, root=src)
    part = out / "p1" / m["parts"][1]["name"]
    good = part.read_bytes()
    part.write_bytes(b"x" + good[1:])
    with pytest.raises(SystemExit, match="sha256 .* differs from the manifest"):
        gpu_parts.stage(out / "p1", tmp_path / "s")
    part.write_bytes(good)
    gpu_parts.stage(out / "p0", tmp_path / "s")
    with pytest.raises(SystemExit, match=r"parts \['part001'"):
        gpu_parts.join(tmp_path / "s", tmp_path)
    for k in range(1, len(m["parts"])):
        gpu_parts.stage(out / f"p{k}", tmp_path / "s")
    host = tmp_path / "host"
    (host / "work" / "journal").mkdir(parents=True)
    (host / "work" / "journal" / "j.jsonl").write_text("newer answers\n")
    with pytest.raises(SystemExit, match="exists with other content"):
        gpu_parts.join(tmp_path / "s", host)
    assert (host / "work" / "journal" / "j.jsonl").read_text() == "newer answers\n"
    other = gpu_parts.split(tmp_path / "other", ["work/journal"], part_mib=1, root=src)
    assert other["bundle_sha256"] != m["bundle_sha256"]
    with pytest.raises(SystemExit, match="parts of another bundle"):
        gpu_parts.stage(tmp_path / "other" / "p0", tmp_path / "s")


def test_paths_outside_the_checkout_and_a_used_folder_are_refused(src, tmp_path):
    with pytest.raises(SystemExit, match="outside"):
        gpu_parts.split(tmp_path / "a", ["../"], 1, root=src)
    with pytest.raises(SystemExit, match="relative to the checkout"):
        gpu_parts.split(tmp_path / "b", [str(src / "work")], 1, root=src)
    with pytest.raises(SystemExit, match="no such file"):
        gpu_parts.split(tmp_path / "c", ["work/nothing"], 1, root=src)
    gpu_parts.split(tmp_path / "d", ["work"], 1, root=src)
    with pytest.raises(SystemExit, match="not empty"):
        gpu_parts.split(tmp_path / "d", ["work"], 1, root=src)


def test_a_member_that_escapes_the_root_is_not_unpacked(tmp_path):
    """A bundle made elsewhere (its manifest consistent) that names ../ is refused by the filter."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    data = buf.getvalue()
    import hashlib
    staged = tmp_path / "s"
    staged.mkdir()
    (staged / "part000").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    (staged / "manifest.json").write_text(json.dumps({"bundle_sha256": sha, "bytes": len(data), "paths": [],
                                                      "parts": [{"name": "part000", "bytes": len(data), "sha256": sha}]}))
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(tarfile.OutsideDestinationError):
        gpu_parts.join(staged, root)
    assert not (tmp_path / "escaped.txt").exists() and not (staged / "bundle.tar.tmp").exists()


def test_auto_parts_fill_what_a_call_carries_beside_the_checkout(tmp_path):
    """`--part-mib auto`: the call's limit less the disk use of the files that travel (tracked and
    untracked-not-ignored, not the ignored), a part's manifest block and a margin; refused when
    too little is left."""
    import subprocess
    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text("work/\n")
    (root / "tracked.bin").write_bytes(b"x" * (3 << 20))
    (root / "untracked.bin").write_bytes(b"y" * (1 << 20))
    (root / "work").mkdir()
    (root / "work" / "ignored.bin").write_bytes(b"z" * (8 << 20))
    subprocess.run(["git", "-C", str(root), "add", "tracked.bin", ".gitignore"], check=True)
    travelling = gpu_parts.travelling_mib(root)
    assert 4.0 <= travelling < 4.1
    assert gpu_parts.auto_part_mib(root, limit=64.0) == 59.0        # 64 - 4.0x - 0.5 - a block, by 0.5
    with pytest.raises(SystemExit, match="too little for a part"):
        gpu_parts.auto_part_mib(root, limit=5.0)


def test_gpu_lean_takes_folders_out_of_the_index_and_puts_them_back(tmp_path):
    # workflow/gpu_lean.sh in a scratch repository: `on` leaves the KEEP folder and every file on
    # disk, takes the others out of what travels (tracked + untracked-not-ignored); `off` restores
    # the index as HEAD has it and the exclude file as it was
    import shutil
    script = Path(__file__).resolve().parents[2] / "workflow" / "gpu_lean.sh"
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True,  # noqa: E731
                                    capture_output=True, text=True).stdout
    git("init", "-q")
    git("config", "user.email", "t@t"), git("config", "user.name", "t")
    for rel in ("results/a/x.json", "results/keep/y.json", "notebooks/n.ipynb", "src/m.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    git("add", "-A"), git("commit", "-qm", "init")
    exclude = (tmp_path / ".git/info/exclude").read_text()
    travels = lambda: sorted(git("ls-files", "-co", "--exclude-standard").split())  # noqa: E731
    run = lambda *a: subprocess.run(["bash", str(script), *a], cwd=tmp_path, capture_output=True, text=True)  # noqa: E731
    assert run("on", "results/nope").returncode != 0          # a KEEP folder that is not there
    assert run("on", "results/keep").returncode == 0
    assert travels() == ["results/keep/y.json", "src/m.py"]
    assert (tmp_path / "results/a/x.json").read_text() == "results/a/x.json"
    assert run("on").returncode != 0                           # twice: refused
    assert run("off").returncode == 0
    assert travels() == ["notebooks/n.ipynb", "results/a/x.json", "results/keep/y.json", "src/m.py"]
    assert git("status", "--short") == "" and (tmp_path / ".git/info/exclude").read_text() == exclude
    assert run("off").returncode != 0
    shutil.rmtree(tmp_path / ".git")
