from pathlib import Path

import pytest

from attnforge.jit import arch, env


def test_parse_arch_list():
    assert arch.parse_arch_list("9.0a; 8.0+PTX 9.0a") == ("8.0+PTX", "9.0a")
    assert arch.gencode_flags(("9.0a",)) == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert arch.gencode_flags(("8.0+PTX",)) == ["-gencode=arch=compute_80,code=sm_80",
                                                "-gencode=arch=compute_80,code=compute_80"]
    assert arch.artifact_suffix(("9.0a",)) == "cubin"
    assert arch.artifact_suffix(("8.0", "9.0a")) == "fatbin"
    with pytest.raises(ValueError, match="ATTNFORGE_CUDA_ARCH_LIST"):
        arch.parse_arch_list("sm90")
    for bad in ("90a", "sm_90a"):  # archs handed straight to a build get the same message, not an AttributeError
        with pytest.raises(ValueError, match=r"expected forms like '9\.0a'.*not 'sm_90a'"):
            arch.gencode_flags((bad,))


def test_arch_list_env_precedence(monkeypatch):
    monkeypatch.setenv("ATTNFORGE_CUDA_ARCH_LIST", "")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    assert arch.arch_list() == ("8.0",)
    monkeypatch.setenv("ATTNFORGE_CUDA_ARCH_LIST", "9.0a")
    assert arch.arch_list() == ("9.0a",)


def test_knobs_typed(monkeypatch):
    monkeypatch.setenv("ATTNFORGE_JIT_VERBOSE", "1")
    assert env.JIT_VERBOSE.value is True
    monkeypatch.setenv("MAX_JOBS", "3")
    assert env.MAX_JOBS.value == 3
    monkeypatch.setenv("MAX_JOBS", "many")
    with pytest.raises(ValueError, match="MAX_JOBS='many'"):
        env.MAX_JOBS.value


def test_every_knob_is_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    missing = [k.name for k in env.ALL_KNOBS if f"`{k.name}`" not in doc]
    assert not missing, f"docs/architecture.md lacks {missing}; paste env.markdown_table()"
