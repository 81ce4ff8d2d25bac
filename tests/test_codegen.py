import re

import jinja2
import jinja2.meta
import pytest

from attnforge import AttentionSpec, codegen
from attnforge.codegen import ParamField, ParamsLayout
from attnforge.kernels import module_for_attention
from attnforge.merge import MergeSpec

# kernel families, and (in subfolders) the parts a family's template includes
TEMPLATES = sorted(p.relative_to(codegen.templates_dir()).as_posix() for p in codegen.templates_dir().rglob("*.jinja"))


@pytest.mark.parametrize("name", TEMPLATES)
def test_header_comment_lists_every_variable(name):
    text = (codegen.templates_dir() / name).read_text()
    header = re.match(r"\{#-?(.*?)-?#\}", text, re.S)
    assert header, f"{name} must start with a {{# ... #}} comment listing its variables"
    env = codegen._env()
    used = jinja2.meta.find_undeclared_variables(env.parse(text))
    missing = [v for v in used if not re.search(rf"\b{v}\b", header.group(1))]
    assert not missing, f"{name}: variables used but not documented in the header: {missing}"
    assert used or "/" in name, f"{name}: a kernel family's template with no variables"


def test_every_part_is_included_by_a_family_template():
    families = [(codegen.templates_dir() / t).read_text() for t in TEMPLATES if "/" not in t]
    for part in (p for p in TEMPLATES if "/" in p):
        # a part is included (code) or has its macros imported
        assert any(f'{{% include "{part}" %}}' in text or f'{{% from "{part}" import' in text for text in families), \
            f"{part} is included nowhere"


def test_strict_undefined_raises():
    with pytest.raises(jinja2.UndefinedError):
        codegen.render("merge_states.cu.jinja", {"dtype": "float"})


def test_rendering_is_deterministic():
    spec = AttentionSpec(logits_soft_cap=30.0, window_left=128)
    a = module_for_attention(spec).source
    b = module_for_attention(AttentionSpec(logits_soft_cap=30.0, window_left=128)).source
    assert a == b and "SoftCapVariant" in a and "WithPositionMask" in a


def test_runtime_values_do_not_change_source():
    # The soft-cap and window values are runtime scalars: one build serves them all.
    a = module_for_attention(AttentionSpec(logits_soft_cap=30.0, window_left=10))
    b = module_for_attention(AttentionSpec(logits_soft_cap=50.0, window_left=999))
    assert a.source == b.source and a.name == b.name
    assert module_for_attention(AttentionSpec()).source != a.source


def test_params_layout_matches_ctypes():
    layout = ParamsLayout("P", [ParamField("a", "int32_t", "i32"), ParamField("p", "void*", "ptr"),
                                ParamField("f", "float", "f32")])
    assert layout.size == 24  # 4 + pad 4 + 8 + 4 + pad 4: the C rules ctypes follows
    assert "static_assert(sizeof(P) == 24" in layout.cpp()
    with pytest.raises(TypeError, match="missing"):
        layout.pack(a=1)
    with pytest.raises(ValueError, match="unknown param kinds"):
        ParamsLayout("Q", [ParamField("x", "double", "f64")])


def test_packing_refuses_a_value_its_32_bit_field_would_wrap():
    """ctypes wraps an int past 32 bits silently (10**12 -> -727379968) and rounds a float past float32's range to
    inf: pack refuses both, naming the field, so an input no check caught fails on the host, not as garbage in the
    kernel; the bounds themselves, and infinities, pack."""
    layout = ParamsLayout("P", [ParamField("n", "int32_t", "i32"), ParamField("m", "uint32_t", "u32"),
                                ParamField("s", "int64_t", "i64")])
    ok = layout.pack(n=-2 ** 31, m=2 ** 32 - 1, s=10 ** 12)
    assert (ok.n, ok.m, ok.s) == (-2 ** 31, 2 ** 32 - 1, 10 ** 12)
    with pytest.raises(OverflowError, match=r"P.n = 1000000000000 does not fit the kernel's 32-bit field"):
        layout.pack(n=10 ** 12, m=0, s=0)
    with pytest.raises(OverflowError, match=r"P.m = -1 does not fit .*\[0, 4294967295\]"):
        layout.pack(n=0, m=-1, s=0)
    with pytest.raises(OverflowError, match=r"P.n = 2147483648"):
        layout.template(["s"], n=2 ** 31, m=0)
    floats = ParamsLayout("F", [ParamField("x", "float", "f32")])
    for fine in (3.4e38, -3.4e38, float("inf"), float("-inf"), 1e-45):  # (infinities are sentinels some kernels take)
        floats.pack(x=fine)
    with pytest.raises(OverflowError, match=r"F.x = 1e\+39 does not fit the kernel's float32 field"):
        floats.pack(x=1e39)


def test_tensor_map_fields_come_first_and_align_the_struct():
    maps = [ParamField("km", "TensorMap", "tmap"), ParamField("vm", "TensorMap", "tmap")]
    layout = ParamsLayout("P", [*maps, ParamField("n", "int32_t", "i32")])
    assert layout.size == 320  # 2 x 128 + 4, padded to the 64-byte alignment the C++ struct declares
    assert "struct alignas(64) P" in layout.cpp() and "static_assert(sizeof(P) == 320" in layout.cpp()
    packed = layout.pack(km=bytes(range(128)), vm=None, n=7)  # None: an unused map, zeros
    raw = bytes(packed)
    assert raw[:128] == bytes(range(128)) and raw[128:256] == bytes(128) and raw[256:260] == (7).to_bytes(4, "little")
    with pytest.raises(ValueError, match="tensor-map fields must come first"):
        ParamsLayout("Q", [ParamField("n", "int32_t", "i32"), *maps])


def test_merge_module_renders_types():
    import torch
    src = MergeSpec(torch.float32, torch.float16).module().source
    assert "using T = float;" in src and "using TOut = fp16;" in src


@pytest.mark.parametrize("family", ["decode", "prefill", "mla_decode"])
def test_params_field_offsets_match_a_c_compiler(family, tmp_path):
    """ctypes (host packing) and the C++ struct place every field at the same offset (g++ offsetof;
    every pointer type is 8 bytes like void*)."""
    import shutil
    import subprocess

    import torch

    import attnforge.mods as m
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    from attnforge.kernels.decode import DecodeKernel
    from attnforge.kernels.prefill import PrefillKernel
    from attnforge.kernels.mla import MLADecodeKernel
    mla = {"num_qo_heads": 32, "num_kv_heads": 1, "head_dim_qk": 576, "head_dim_vo": 512} if family == "mla_decode" else {}
    spec = AttentionSpec(family=family, score_mod=m.relative_position_bias(torch.zeros(32, 3), 1), **mla)
    layout = {"decode": DecodeKernel, "prefill": PrefillKernel, "mla_decode": MLADecodeKernel}[family](spec).params
    body = "\n".join(f"  {'void*' if f.kind == 'ptr' else f.cpp_type} {f.name};" for f in layout.fields)
    prints = "\n".join(f'  std::printf("%zu\\n", offsetof(P, {f.name}));' for f in layout.fields)
    src = tmp_path / "p.cpp"
    align = "alignas(64) " if layout.has_tmap else ""
    src.write_text(f"#include <cstddef>\n#include <cstdint>\n#include <cstdio>\n"
                   f"struct alignas(64) TensorMap {{ uint64_t opaque[16]; }};\nstruct {align}P {{\n{body}\n}};\n"
                   f"int main() {{\n{prints}\n  std::printf(\"%zu\\n\", sizeof(P));\n}}\n")
    subprocess.run(["g++", "-o", str(tmp_path / "p"), str(src)], check=True)
    got = [int(x) for x in subprocess.run([str(tmp_path / "p")], capture_output=True, text=True).stdout.split()]
    want = [getattr(layout.ctype, f.name).offset for f in layout.fields] + [layout.size]
    assert got == want


def _classes_with_default_members(text: str) -> set:
    """Names of the structs in `text` with a default member initialiser (`float m = ...;` or `x{...};`),
    directly or through a member of such a struct (nvcc zeroes those too past a 2D array's first row)."""
    bodies = dict((m.group(1), m.group(2)) for m in re.finditer(r"struct (\w+)[^;{]*\{(.*?)\n\};", text, re.S))
    found = {name for name, body in bodies.items()
             if re.search(r"^\s+[\w:<>]+ +\w+(\[[^]]*\])* *(=[^=]|\{[^}]*\};)", body, re.M)}
    while True:
        more = {name for name, body in bodies.items() if name not in found
                and any(re.search(rf"^\s+{inner} +\w", body, re.M) for inner in found)}
        if not more:
            return found
        found |= more


def _multidimensional_arrays_of(text: str, classes: set) -> list:
    return [m.group(0) for m in re.finditer(r"\b(\w+) +\w+ *\[[^]]+\] *\[[^]]+\]", text) if m.group(1) in classes]


def test_no_multidimensional_arrays_of_classes_with_default_members():
    """nvcc 13.0 list-initialises (`State st{}`) only the first row of a 2D array of a class with default
    member initialisers and zeroes the rest: the transposed decode kernel's second head tile started its
    running max at 0, not -inf (forty-fifth session). Kernel code keeps such arrays one-dimensional."""
    example = "struct S {\n  float m = -1.f;\n};\nstruct I {\n  S s;\n};\nstruct W {\n  S rows[2][2];\n  I more[2][3];\n};"
    assert _multidimensional_arrays_of(example, _classes_with_default_members(example)) == ["S rows[2][2]", "I more[2][3]"]
    sources = [*codegen.templates_dir().rglob("*.jinja"), *codegen.include_dir().rglob("*.cuh")]
    texts = {p.name: p.read_text() for p in sources}
    classes = _classes_with_default_members("\n".join(texts.values()))  # (headers' classes in templates' structs)
    assert {"SoftmaxState", "AffineHead", "WarpState"} <= classes  # the scan sees the kernels' state classes
    offenders = {name: found for name, t in texts.items() if (found := _multidimensional_arrays_of(t, classes))}
    assert not offenders, (f"2D arrays of classes with default member initialisers: {offenders}; nvcc 13.0 "
                           f"value-initialises only their first row. Flatten them ([2 * i + j]).")


def test_params_template_sets_only_a_runs_fields():
    layout = ParamsLayout("P", [ParamField("q", "void*", "ptr"), ParamField("n", "int32_t", "i32"),
                                ParamField("f", "float", "f32")])
    template = layout.template(("q",), n=7, f=0.5)
    a, b = template.fill(q=16), template.fill(q=32)
    assert (a.q, a.n, a.f, b.q) == (16, 7, 0.5, 32)
    assert bytes(template.fill(q=16)) == bytes(layout.pack(q=16, n=7, f=0.5))  # the same bytes a full pack gives
    with pytest.raises(TypeError, match="a run sets exactly"):
        template.fill(q=1, n=2)
    with pytest.raises(TypeError, match="both fixed and per run"):
        layout.template(("q",), q=1, n=7, f=0.5)
    with pytest.raises(TypeError, match="missing"):
        layout.template(("q",), n=7)


def test_a_narrowed_template_fixes_more_fields_and_leaves_its_parent_alone():
    layout = ParamsLayout("P", [ParamField("km", "TensorMap", "tmap"), ParamField("q", "void*", "ptr"),
                                ParamField("out", "void*", "ptr"), ParamField("n", "int32_t", "i32")])
    template = layout.template(("q", "out", "km"), n=7)
    raw = bytes(range(128))
    narrow = template.narrowed(q=16, km=raw)
    assert bytes(narrow.fill(out=48)) == bytes(layout.pack(q=16, out=48, km=raw, n=7))
    assert bytes(template.fill(q=32, out=64, km=None)) == bytes(layout.pack(q=32, out=64, km=None, n=7))
    with pytest.raises(TypeError, match="a run sets exactly"):
        narrow.fill(q=1, out=2)
    with pytest.raises(TypeError, match=r"only per-run fields can be fixed, got \['n'\]"):
        template.narrowed(n=3)


def test_params_templates_are_kept_by_their_values():
    """A plan whose fixed fields equal an earlier plan's reuses its template; any other value builds its own."""
    layout = ParamsLayout("P", [ParamField("q", "void*", "ptr"), ParamField("n", "int32_t", "i32"),
                                ParamField("f", "float", "f32")])
    t7 = layout.template(("q",), n=7, f=0.5)
    assert layout.template(("q",), n=7, f=0.5) is t7
    t8 = layout.template(("q",), n=8, f=0.5)
    assert t8 is not t7 and (t8.fill(q=1).n, t7.fill(q=1).n) == (8, 7)
    assert layout.template(("n",), q=0, f=0.5) is not t7  # other per-run fields: another template
    for n in range(3 * ParamsLayout.MAX_TEMPLATES):  # the table stays small
        assert layout.template(("q",), n=n, f=0.25).fill(q=2).n == n
    assert len(layout._templates) <= ParamsLayout.MAX_TEMPLATES


def test_params_template_packs_per_run_tensor_maps():
    layout = ParamsLayout("P", [ParamField("km", "TensorMap", "tmap"), ParamField("n", "int32_t", "i32")])
    raw = bytes(range(128))
    packed = layout.template(("km",), n=3).fill(km=raw)
    assert bytes(packed)[:128] == raw and packed.n == 3
    assert bytes(layout.template(("km",), n=3).fill(km=None))[:128] == bytes(128)
    fixed_map = layout.template(("n",), km=bytearray(raw))  # (an unhashable value: built, not kept)
    assert bytes(fixed_map.fill(n=1))[:128] == raw and not any(isinstance(k[1][0][1], bytearray)
                                                               for k in layout._templates)
