"""tools/stage_package.sh: a revision plus patches staged as a renamed package that imports nothing of the
original, builds from its own headers, and takes the patch (run in a clone, so the checkout stays clean)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("git") is None or shutil.which("patch") is None
                                or not (ROOT / ".git").exists(), reason="needs git, patch and a git checkout")


def test_a_patched_revision_imports_as_its_own_package(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    shutil.copy(ROOT / "tools" / "stage_package.sh", clone / "tools" / "stage_package.sh")  # this tree's script
    header = "csrc_include/attnforge/cp_async.cuh"
    lines = (clone / header).read_text().splitlines(keepends=True)
    patch = tmp_path / "mark.patch"  # one added line after the first: a unified diff made by hand
    patch.write_text(f"--- a/{header}\n+++ b/{header}\n@@ -1,1 +1,2 @@\n {lines[0]}+// staged-patch-marker\n")
    out = subprocess.run(["bash", "tools/stage_package.sh", "t1", "HEAD", str(patch)], cwd=clone,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    staged = clone / ".stage_t1"
    assert "// staged-patch-marker" in (staged / header).read_text()
    assert "// staged-patch-marker" not in (clone / header).read_text()
    probe = ("import sys, attnforge_t1; from attnforge_t1 import AttentionSpec, codegen; "
             "assert 'attnforge' not in sys.modules; print(codegen.include_dir())")
    got = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(staged), "PATH": ""},
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()) == staged / "csrc_include"
    assert "/.stage_t1/" in (clone / ".git" / "info" / "exclude").read_text()


def test_a_bad_name_is_refused_with_the_usage(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "tools" / "stage_package.sh"), "Bad-Name"], capture_output=True,
                         text=True)
    assert out.returncode == 2 and "usage: bash tools/stage_package.sh NAME" in out.stderr and "Bad-Name" in out.stderr
