"""Every name a function or module reads is bound somewhere it can be found: a local, an enclosing function's, the
module's, or a builtin. The GPU tests and the benchmarks cannot run on CI's machine, so a name left behind by a
refactor would otherwise surface only on the GPU (it did: the MLA tests' `run_case` returned a `ref` that the helper
extracted from it had taken away). `symtable` resolves scopes as the compiler does, so closures, lambdas
and comprehensions need no special cases."""
import builtins
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE_DUNDERS = {"__file__", "__name__", "__doc__", "__spec__", "__package__", "__loader__", "__path__",
                  "__builtins__", "__annotations__", "__dict__", "__class__"}  # (__class__: super()'s cell)
KNOWN = set(dir(builtins)) | MODULE_DUNDERS


def sources() -> list[Path]:
    """The package, its tests, benchmarks and committed tools (scratch `tools/_*` is gitignored)."""
    files = [p for d in ("attnforge", "tests", "benchmarks", "tools") for p in (ROOT / d).rglob("*.py")]
    return sorted(p for p in files if not (p.parent == ROOT / "tools" and p.name.startswith("_")))


def module_bindings(table: symtable.SymbolTable) -> set[str]:
    """Names bound at module level, including by `global x` assignments inside functions."""
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    stack = list(table.get_children())
    while stack:
        t = stack.pop()
        bound |= {s.get_name() for s in t.get_symbols() if s.is_declared_global() and s.is_assigned()}
        stack.extend(t.get_children())
    return bound


def unbound_reads(source: str, filename: str) -> list[str]:
    """'scope: name' for each name read in a scope that resolves to the module or builtins and is bound in neither."""
    top = symtable.symtable(source, filename, "exec")
    if any(s.get_name() == "*" for s in top.get_symbols()):  # a star import binds names the table cannot see
        return []
    known = KNOWN | module_bindings(top)
    found, stack = [], [top]
    while stack:
        t = stack.pop()
        for s in t.get_symbols():
            name = s.get_name()
            reads_global = t.get_type() == "module" or s.is_global()  # (a function's implicit or declared global)
            if s.is_referenced() and reads_global and name not in known:
                found.append(f"{t.get_name()}: {name}")
        stack.extend(t.get_children())
    return found


def test_the_checker_finds_a_name_a_refactor_left_behind():
    """Negative controls: the checker is not vacuous (each of these fails at run time with NameError)."""
    left_behind = "def run():\n    out = 1\n    return out, ref\n"
    assert unbound_reads(left_behind, "x.py") == ["run: ref"]
    in_lambda = "def f(xs):\n    return sorted(xs, key=lambda x: x[keyed])\n"
    assert unbound_reads(in_lambda, "x.py") == ["lambda: keyed"]
    at_module = "import os\nprint(os.sep, path)\n"
    assert unbound_reads(at_module, "x.py") == ["top: path"]
    fine = ("import os\nG = 1\ndef f(a):\n    global H\n    H = 2\n    def g():\n        return a + G + H\n"
            "    return [g() for _ in range(len(os.sep))], __file__\n")
    assert unbound_reads(fine, "x.py") == []


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_read_name_is_bound(path):
    found = unbound_reads(path.read_text(), str(path))
    assert not found, f"{path.relative_to(ROOT)} reads names bound nowhere (a NameError when that line runs): {found}"
