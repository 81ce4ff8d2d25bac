"""Modifiers' generated C++ built for the host with g++ and run on given inputs (the CPU side of the
score-mod tests): each mod's functions from `ScoreMod.host_functions()`, an accessor that serves its
captured tensors and scalars from static arrays, and a main that prints one value a call and input."""
import subprocess
from pathlib import Path

import torch


def _access_struct(mod, ns: str) -> str:
    """namespace `ns` { the mod's tensors as arrays; struct HostAccess: load_f / load_i / scalar }."""
    tensors = []
    for k, t in enumerate(mod.tensors):
        vals = ", ".join(repr(float(v)) + "f" if t.is_floating_point() else f"{int(v)}LL" for v in t.flatten().tolist())
        ctype = "float" if t.is_floating_point() else "long long"
        sizes = ", ".join(str(s) for s in t.shape)
        tensors.append(f"static const {ctype} T{k}[] = {{{vals}}}; static const long long S{k}[] = {{{sizes}}};")

    def loader(kind):
        ctype = "float" if kind == "f" else "af_int"
        return "\n".join(f"    if (k == {k}) {{ long long off = 0; int d = 0; for (af_int i : idx) {{ "
                         f"off = off * S{k}[d] + af_index(i, S{k}[d]); ++d; }} return (({ctype})T{k}[off]); }}"
                         for k in mod.slots)
    scalars = "\n".join(f"    if (k == {k}) return {float(v)!r}f;" for k, v in enumerate(mod.scalars))
    return f"""namespace {ns} {{
{chr(10).join(tensors)}
struct HostAccess {{
  float load_f(int k, std::initializer_list<af_int> idx) const {{
{loader("f")}
    return 0.f;
  }}
  af_int load_i(int k, std::initializer_list<af_int> idx) const {{
{loader("i")}
    return 0;
  }}
  float scalar(int k) const {{
{scalars}
    return 0.f;
  }}
}};
}}"""


def default_call(mod) -> str:
    """The mod's score function (or its mask, as a float) on input row `in[i]` with accessor `a`."""
    n = mod.cpp_struct_name
    if mod.score_root is not None:
        return f"{n}_score(in[i].s, in[i].b, in[i].h, in[i].q, in[i].kv, a)"
    return f"(float){n}_mask(in[i].b, in[i].h, in[i].q, in[i].kv, a)"


def program(calls, inputs) -> str:
    """calls: (mod, C++ expression over `in[i]` and `a`) pairs; inputs: (score, b, h, q, kv) rows. Prints
    every call's value on every row, call after call."""
    functions, blocks = {}, []
    for j, (mod, call) in enumerate(calls):
        functions.setdefault(mod.cpp_struct_name, mod.host_functions())  # equal graphs: one definition
        blocks.append(f"{_access_struct(mod, f'm{j}')}\n"
                      f"static void run{j}() {{\n  m{j}::HostAccess a;\n"
                      f"  for (unsigned i = 0; i < kRows; ++i) std::printf(\"%.9g\\n\", (double)({call}));\n}}")
    runs = "\n".join(f"  run{j}();" for j in range(len(calls)))
    return f"""#include <cstdio>
#include <initializer_list>
{chr(10).join(functions.values())}
{_input_table(inputs)}
{chr(10).join(blocks)}
int main() {{
{runs}
}}
"""


def _input_table(inputs) -> str:
    """The (score, b, h, q, kv) rows as `in[kRows]` (after the prelude: af_int)."""
    rows = "\n".join(f"  {{{s!r}f, {b}, {h}, {q}, {kv}}}," for s, b, h, q, kv in inputs)
    return f"""struct In {{ float s; af_int b, h, q, kv; }};
static const In in[] = {{
{rows}
}};
static const unsigned kRows = sizeof(in) / sizeof(in[0]);"""


# nvcc fuses a * b + c into one FMA by default; g++ does the same with these flags on a CPU that has FMA
DEVICE_LIKE = ("-mfma", "-ffp-contract=fast")


def host_has_fma() -> bool:
    try:
        return " fma " in f" {Path('/proc/cpuinfo').read_text()} ".replace("\n", " ")
    except OSError:
        return False


def run_calls(calls, inputs, directory: Path, flags=()) -> torch.Tensor:
    """program() compiled with g++ (and `flags`) and run: [len(calls), len(inputs)] float32 values (printed
    with 9 significant digits, which round-trip a float32 exactly)."""
    return _build_and_run(program(calls, inputs), directory / "mods", flags).view(len(calls), len(inputs))


def _build_and_run(source: str, exe: Path, flags=()) -> torch.Tensor:
    """source built with g++ as `exe` and run: the float32 values it printed."""
    src = exe.with_suffix(".cpp")
    src.write_text(source)
    subprocess.run(["g++", "-std=c++17", "-O2", *flags, "-o", str(exe), str(src)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return torch.tensor([float(x) for x in out.split()], dtype=torch.float32)


def run_on_host(mod, inputs, directory: Path, call=None) -> torch.Tensor:
    """One mod's values on the inputs (its score function, or `call`)."""
    return run_calls([(mod, call or default_call(mod))], inputs, directory)[0]


def device_accessor_program(mod, inputs) -> str:
    """The kernels' own accessor (`ScoreMod.cpp_decl`, which reads each captured tensor through a pointer of its
    element's C type) over a params struct of the mod's fields, its tensors' bytes as static arrays: the host
    check of how the device reads int8 / uint8 / int16 / bool / int64 elements (signs, widths, strides)."""
    n = mod.cpp_struct_name
    decl = mod.cpp_decl.split(f"struct {n} : attnforge::IdentityVariant")[0]  # (the rest needs the CUDA headers)
    fields = "\n".join(f"  {f.cpp_type} {f.name};" for f in mod.param_fields())
    arrays, sets = [], []
    for name, value in mod.param_values(torch.device("cpu")).items():
        k = name[len("mod_t"):] if name.startswith("mod_t") and name[len("mod_t"):].isdigit() else None
        if k is not None:
            data = mod.tensors[int(k)].contiguous().view(-1).view(torch.uint8).tolist()
            arrays.append(f"alignas(16) static const unsigned char B{k}[] = {{{', '.join(map(str, data)) or '0'}}};")
            sets.append(f"  p.{name} = B{k};")
        else:
            sets.append(f"  p.{name} = {value!r};")
    return f"""#include <cstdio>
#include <cstdint>
{decl}
struct P {{
{fields}
}};
{chr(10).join(arrays)}
{_input_table(inputs)}
int main() {{
  P p;
{chr(10).join(sets)}
  const {n}_Access<P> a{{p}};
  for (unsigned i = 0; i < kRows; ++i) std::printf("%.9g\\n", (double)({default_call(mod)}));
}}
"""


def run_device_accessor(mod, inputs, directory: Path) -> torch.Tensor:
    """device_accessor_program() built with g++ and run: one float32 value an input row."""
    return _build_and_run(device_accessor_program(mod, inputs), directory / "access")
