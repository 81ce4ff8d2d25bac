"""The wheel ships every subpackage, the templates and the headers (a non-editable install works)."""
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "attnforge").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to pyproject.toml"


def test_wheel_contains_templates_and_headers(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True)
    names = zipfile.ZipFile(next(tmp_path.glob("attnforge-*.whl"))).namelist()
    for template in (REPO / "templates").rglob("*.jinja"):  # the families and their included parts
        assert f"attnforge/_data/templates/{template.relative_to(REPO / 'templates').as_posix()}" in names
    for header in (REPO / "csrc_include" / "attnforge").glob("*.cuh"):
        assert f"attnforge/_data/csrc_include/attnforge/{header.name}" in names
    assert "attnforge/mods/trace.py" in names and "attnforge/kernels/prefill.py" in names


def test_installed_package_finds_its_data(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "w"), str(REPO)], check=True, capture_output=True)
    wheel = next((tmp_path / "w").glob("attnforge-*.whl"))
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = ("import attnforge, attnforge.codegen as c; from attnforge.kernels import module_for_attention; "
            "m = module_for_attention(attnforge.AttentionSpec()); assert 'batch_decode_kernel' in m.source; "
            "print(c.templates_dir(), c.include_dir())")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert str(tmp_path / "site" / "attnforge" / "_data") in r.stdout
