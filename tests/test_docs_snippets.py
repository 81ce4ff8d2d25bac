"""The Python in the README, docs/serving.md and docs/mods.md is checked against the package, so that the docs cannot
drift from the API: every block parses; every `attnforge...` name and import resolves; and every call of an
attnforge function, class or method (where the method's object was built by a visible
`x = attnforge.Class(...)`) binds its keyword and positional arguments to the real signature.
The snippets do not run (they need a GPU and the caller's tensors)."""
import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/serving.md", "docs/mods.md")


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def resolve(dotted: str):
    """attnforge.a.b.c -> the object, importing submodules on the way."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if not hasattr(obj, part):
            obj = importlib.import_module(".".join(parts[: i + 1]))
        else:
            obj = getattr(obj, part)
    return obj


def dotted_name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


class SnippetChecker(ast.NodeVisitor):
    def __init__(self):
        self.names = {"attnforge": "attnforge"}  # local name -> dotted attnforge path
        self.instances = {}  # local name -> the attnforge class it was built from
        self.checked_calls = 0

    def visit_ImportFrom(self, node):
        if node.module and node.module.split(".")[0] == "attnforge":
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                resolve(path)
                self.names[alias.asname or alias.name] = path

    def visit_Assign(self, node):
        self.generic_visit(node)
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Call):
            target = self.attnforge_object(node.value.func)
            if inspect.isclass(target):
                self.instances[node.targets[0].id] = target

    def attnforge_object(self, func):
        name = dotted_name(func)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        if head in self.names:
            return resolve(self.names[head] + (f".{rest}" if rest else ""))
        if head in self.instances and rest and "." not in rest:
            return getattr(self.instances[head], rest)  # a method: AttributeError if the docs name a wrong one
        return None

    def visit_Attribute(self, node):
        name = dotted_name(node)
        if name and name.split(".")[0] in self.names:
            self.attnforge_object(node)  # raises if the name does not exist
        self.generic_visit(node)

    def visit_Call(self, node):
        self.generic_visit(node)
        target = self.attnforge_object(node.func)
        if target is None or not callable(target):
            return
        sig = inspect.signature(target.__init__ if inspect.isclass(target) else target)
        params = list(sig.parameters.values())
        is_method = params and params[0].name == "self"
        args = [object()] * ((1 if is_method else 0) + len(node.args))
        kwargs = {kw.arg: object() for kw in node.keywords if kw.arg is not None}
        sig.bind_partial(*args, **kwargs)  # TypeError: a keyword the function does not take, or too many args
        self.checked_calls += 1


@pytest.mark.parametrize("doc", DOCS)
def test_python_snippets_match_the_package(doc):
    blocks = python_blocks(ROOT / doc)
    assert blocks, f"{doc} has no python blocks"
    calls = 0
    for block in blocks:
        checker = SnippetChecker()
        checker.visit(ast.parse(block))
        calls += checker.checked_calls
    assert calls >= 3, f"{doc}: only {calls} attnforge calls checked"


def test_the_checker_catches_a_wrong_keyword_and_a_missing_name():
    checker = SnippetChecker()
    with pytest.raises(TypeError):
        checker.visit(ast.parse("import attnforge\nd = attnforge.BatchDecode(None)\nd.plan(page_sise=16)"))
    with pytest.raises((AttributeError, ModuleNotFoundError)):
        SnippetChecker().visit(ast.parse("import attnforge\nattnforge.BatchDecoder(None)"))
    with pytest.raises(AttributeError):
        SnippetChecker().visit(ast.parse("import attnforge\nd = attnforge.BatchDecode(None)\nd.plan_step(1)"))
