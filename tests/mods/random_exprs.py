"""Random modifier functions as Python source, valid in eager torch, for differential tests of the
tracer, the torch evaluation of its graph and the emitted C++.

Every expression carries its type ("f" float32, "i" int64, "b" bool), a bound on |value| (integers stay
far inside 32 bits, where the device's arithmetic agrees with torch's int64) and whether its value is
`exact`: made of +, -, *, //, %, casts, loads, min / max, where and comparisons only, which IEEE float32
gives bit for bit on any machine. Transcendentals and divisions are not exact (libm, SLEEF and the device
differ by an ulp; a constant divisor becomes a reciprocal multiply). Discontinuous operations (comparisons,
floor, %, casts to int) take exact operands only, so an ulp never turns into a jump.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

ROWS, HEADS, POSITIONS, TABLE = 2, 4, 64, 16
SCORE_PARAMS, MASK_PARAMS = "score, b, h, q_idx, kv_idx", "b, h, q_idx, kv_idx"
INT_LIMIT = 2 ** 28  # |integer values| stay below this: no 32-bit overflow anywhere on the device
FLOAT_LIMIT = 1e6


@dataclass(frozen=True)
class Expr:
    src: str
    kind: str  # "f" | "i" | "b"
    bound: float  # |value| <= bound
    exact: bool = True
    const: bool = False  # a Python literal (torch.minimum / maximum want tensors)


def captured(seed: int, device="cpu") -> dict:
    """The tensors a generated function may capture: a float table [HEADS, POSITIONS], an int64, an int8, a uint8
    and a bool table [TABLE] (on `device`), and a 0-d float and a 0-d int (runtime scalars, on the CPU). The byte
    tables are read through `.long()`: eager torch keeps int8 / uint8 arithmetic in 8 bits, the modifiers widen
    elements when read (docs/mods.md)."""
    g = torch.Generator().manual_seed(seed)
    return {"tf": torch.randn(HEADS, POSITIONS, generator=g).to(device),
            "ti": torch.randint(-5, 10, (TABLE,), generator=g).to(device),
            "t8": torch.randint(-128, 128, (TABLE,), generator=g, dtype=torch.int8).to(device),
            "tu": torch.randint(0, 256, (TABLE,), generator=g, dtype=torch.uint8).to(device),
            "tb": (torch.rand(TABLE, generator=g) < 0.5).to(device),
            "s0": torch.tensor(0.75), "n0": torch.tensor(5), "torch": torch}


class Generator:
    """gen(kind, depth) -> Expr over score, b, h, q_idx, kv_idx (score only if with_score).

    For the GPU, whose scores differ from the reference's in their last bits: steps_see_score=False keeps the
    score out of every discontinuous operation's operands (exact=True draws), `bounds` (rows, heads,
    positions: the batch, the query heads, the longest request) bound the integers, float_limit keeps logits
    moderate."""

    def __init__(self, seed: int, with_score: bool = True, steps_see_score: bool = True,
                 bounds: tuple = (ROWS, HEADS, POSITIONS), float_limit: float = FLOAT_LIMIT):
        self.rng = random.Random(seed)
        self.with_score, self.steps_see_score = with_score, steps_see_score
        self.bounds, self.float_limit = dict(zip(("b", "h", "pos"), bounds)), float_limit

    def gen(self, kind: str, depth: int, exact: bool = False) -> Expr:
        """An expression of `kind`; exact=True: its value must be exact (see the module docstring). One
        without inputs that Python folds to a number is marked `const` (torch functions refuse those); a
        boolean one is drawn again (torch.where and ~ would take it as a Python bool)."""
        if exact and self.with_score and not self.steps_see_score:
            self.with_score = False  # (an operand of a step: no score below it)
            try:
                return self.gen(kind, depth, exact)
            finally:
                self.with_score = True
        for _ in range(20):
            e = self._leaf(kind, exact) if depth <= 0 or self.rng.random() < 0.15 else self._node(kind, depth, exact)
            if e is None or e.bound > (INT_LIMIT if kind != "f" else self.float_limit) or (exact and not e.exact):
                continue
            if _python_number(e.src):
                if kind == "b":
                    continue
                e = Expr(e.src, e.kind, e.bound, e.exact, const=True)
            return e
        return self._leaf(kind, exact)

    # -- leaves -------------------------------------------------------------------------------------
    def _leaf(self, kind: str, exact: bool) -> Expr:
        r = self.rng
        if kind == "b":
            if r.random() < 0.15:
                return Expr(f"tb[{self._index('i', TABLE)}]", "b", 1)
            name = r.choice(["h", "q_idx", "kv_idx"])
            return Expr(f"({name} {r.choice(['<', '>=', '==', '!='])} {r.randint(0, 40)})", "b", 1)
        if kind == "i":
            c = r.random()
            if c < 0.6:
                name = r.choice(["b", "h", "q_idx", "kv_idx", "kv_idx", "q_idx"])
                return Expr(name, "i", self.bounds.get(name, self.bounds["pos"]))
            if c < 0.8:
                v = r.randint(-3, 9)
                return Expr(str(v), "i", abs(v), const=True)
            if c < 0.87:
                return Expr("n0", "i", 5)  # a 0-d integer tensor: an integer runtime scalar
            if c < 0.93:
                return Expr(f"ti[{self._index('i', TABLE)}]", "i", 9)
            table = r.choice(["t8", "tu"])
            return Expr(f"{table}[{self._index('i', TABLE)}].long()", "i", 255)
        c = r.random()
        if c < 0.45 and self.with_score:
            return Expr("score", "f", 16)
        if c < 0.65:
            v = r.choice([0.5, -1.25, 3.0, 0.1, 7.5, -0.3])
            return Expr(repr(v), "f", abs(v), const=True)
        if c < 0.75:
            return Expr("s0", "f", 1)
        return Expr(f"tf[{self._index('h', HEADS)}, {self._index('i', POSITIONS)}]", "f", 5)

    def _index(self, what: str, size: int) -> str:
        """An in-range index (eager torch raises on others): x % size, or that minus size (Python's negative
        indices)."""
        x = "h" if what == "h" else self.gen("i", 1, exact=True).src
        return f"({x}) % {size}" if self.rng.random() < 0.7 else f"({x}) % {size} - {size}"

    # -- operations ---------------------------------------------------------------------------------
    def _node(self, kind: str, depth: int, exact: bool):
        return {"f": self._float, "i": self._int, "b": self._bool}[kind](depth - 1, exact)

    def _operands(self, kinds: list[str], depth: int, exact: bool) -> tuple[Expr, Expr]:
        """Two operands of the given kinds in random order."""
        x, y = (self.gen(k, depth, exact) for k in kinds)
        return (x, y) if self.rng.random() < 0.5 else (y, x)

    def _float(self, d: int, exact: bool):
        r = self.rng
        c = r.randrange(14)
        if c == 12:  # rounding, sign, C-style remainder and quotient, in function or method form
            x = self.gen(r.choice(["f", "f", "i"]), d, True)
            if x.const:
                return None
            k = r.choice([0.7, -1.5, 2.5])
            form = r.choice(["torch.floor({})", "torch.ceil({})", "({}).round()", "torch.trunc({})", "torch.sign({})",
                             f"torch.fmod({{}}, {k})", f"torch.div({{}}, {k}, rounding_mode='trunc')",
                             f"({{}}).div({k}, rounding_mode='floor')", "torch.square({})", "({}).abs()",
                             "({}).clamp(min=-2.0)", "({}).clip(-3.0, 3.0)"])
            bound = x.bound ** 2 if "square" in form else x.bound / 0.7 + 3
            return Expr(form.format(x.src), "f" if x.kind == "f" or "." in form.split("(")[-1] else x.kind, bound)
        if c == 13 and not exact:  # the other transcendentals, in function or method form
            x = self.gen("f", d)
            if x.const or x.bound > 1e4:
                return None
            form, bound = r.choice([("torch.log1p(abs({}))", 10), ("torch.expm1(torch.clamp({}, max=8.0))", 2981),
                                    ("torch.rsqrt(abs({}) + 0.5)", 1.5), ("({}).tanh()", 1), ("({}).sigmoid()", 1),
                                    ("({}).exp2().clamp(max=100.0)", 100)])
            return Expr(form.format(x.src), "f", bound, False)
        if c <= 2:  # + - * with at least one float (bool: + and * only; torch refuses - on it)
            op = r.choice("+-*")
            x, y = self._operands(["f", r.choice(["f", "i", "b"] if op != "-" else ["f", "i"])], d, exact)
            bound = x.bound * y.bound if op == "*" else x.bound + y.bound
            return Expr(f"({x.src} {op} {y.src})", "f", bound, x.exact and y.exact)
        if c == 3 and not exact:  # division: a constant, or a runtime divisor kept away from zero
            x = self.gen(r.choice(["f", "i"]), d)
            if r.random() < 0.5:
                v = r.choice([3, 0.7, -2.5, 7])
                return Expr(f"({x.src} / {v})", "f", x.bound / abs(v), False)
            y = self.gen(r.choice(["f", "i"]), d)
            return Expr(f"({x.src} / (abs({y.src}) + 0.5))", "f", 2 * x.bound, False)
        if c == 4:  # float // and % (exact operands: they are discontinuous)
            x = self.gen(r.choice(["f", "i"]), d, True)
            v = r.choice([0.7, -1.5, 2.5, 0.3])
            if r.random() < 0.5:
                return Expr(f"({x.src} // {v})", "f", x.bound / abs(v) + 1)
            return Expr(f"({x.src} % {v})", "f", abs(v))
        if c == 5 and not exact:  # a transcendental
            x = self.gen(r.choice(["f", "f", "i"]), d)
            if x.bound > 1e4 or x.const:
                return None
            fn, bound = r.choice([("torch.tanh({})", 1), ("torch.sigmoid({})", 1), ("torch.sin({})", 1),
                                  ("torch.cos({})", 1), ("torch.exp(torch.clamp({}, -8.0, 8.0))", 2981),
                                  ("torch.exp2(torch.clamp({}, min=-8.0, max=8.0))", 256),
                                  ("torch.log(abs({}) + 1.0)", 10), ("torch.log2(abs({}) + 1.0)", 14),
                                  ("torch.sqrt(abs({}) + 0.25)", 100)])
            return Expr(fn.format(x.src), "f", bound, False)
        if c == 6:  # where, branches of mixed kinds
            cond = self.gen("b", d, True)
            x, y = self._operands(["f", r.choice(["f", "i", "b"])], d, exact)
            return Expr(f"torch.where({cond.src}, {x.src}, {y.src})", "f", max(x.bound, y.bound), x.exact and y.exact)
        if c == 7:  # minimum / maximum of two tensors
            x, y = self._operands(["f", r.choice(["f", "i"])], d, exact)
            if x.const or y.const:
                return None
            fn = r.choice(["torch.minimum", "torch.maximum"])
            return Expr(f"{fn}({x.src}, {y.src})", "f", max(x.bound, y.bound), x.exact and y.exact)
        if c == 8:
            x = self.gen("f", d, exact)
            if x.const:
                return None
            return Expr(r.choice(["abs({})", "(-{})", "torch.clamp({}, -2.0, 3.5)"]).format(x.src), "f", x.bound, x.exact)
        if c == 9:  # casts of integers and booleans
            x = self.gen(r.choice(["i", "b"]), d, exact)
            if x.const:
                return None
            return Expr(f"({x.src}).to(torch.float32)", "f", x.bound, x.exact)
        if c == 10 and not exact:  # powers
            x = self.gen(r.choice(["f", "i"]), d)
            if x.bound > 100:
                return None
            e = r.choice([2.0, 0.5, 1.5])
            return Expr(f"((abs({x.src}) + 0.5) ** {e})", "f", (x.bound + 0.5) ** e, False)
        if c == 11:  # the runtime scalar and the float table
            return self._leaf("f", exact)
        return None

    def _int(self, d: int, exact: bool):
        r = self.rng
        c = r.randrange(11)
        if c == 10:  # C-style quotient and remainder, sign, and method forms
            x = self.gen("i", d, True)
            if x.const:
                return None
            k = r.choice([2, -3, 5])
            form = r.choice([f"torch.div({{}}, {k}, rounding_mode='trunc')", f"torch.fmod({{}}, {k})",
                             "torch.sign({})", "({}).abs()", f"torch.floor_divide({{}}, {k})", f"({{}}).sub({k})",
                             "({}).neg()", "torch.round({})"])
            return Expr(form.format(x.src), "i", x.bound + abs(k))
        if c <= 2:
            op = r.choice("+-*")
            x, y = self._operands(["i", r.choice(["i", "b"] if op != "-" else ["i"])], d, True)
            return Expr(f"({x.src} {op} {y.src})", "i", x.bound * y.bound if op == "*" else x.bound + y.bound)
        if c == 3:  # floor division and modulo by a nonzero divisor of either sign
            x = self.gen("i", d, True)
            div = r.choice([str(r.choice([2, 3, -4, 5, 7])), f"(abs({self.gen('i', d, True).src}) + 1)"])
            return Expr(f"({x.src} {r.choice(['//', '%'])} {div})", "i", x.bound + 1)
        if c == 4:  # bitwise, an operand may be a boolean (0 / 1)
            op = r.choice("&|^")
            x, y = self._operands(["i", r.choice(["i", "b"])], d, True)
            return Expr(f"({x.src} {op} {y.src})", "i", 2 * max(x.bound, y.bound) + 1)
        if c == 5:
            x = self.gen("i", d, True)
            k = r.randint(0, 3)
            if r.random() < 0.5:
                return Expr(f"({x.src} >> {k})", "i", x.bound)
            return Expr(f"({x.src} << {k})", "i", x.bound * 2 ** k)
        if c == 6:
            x = self.gen("i", d, True)
            op = r.choice(["abs({})", "(-{})", "(~{})", "({} ** 2)", "({} ** 3)"])
            return Expr(op.format(x.src), "i", x.bound ** (2 if "2" in op else 3 if "3" in op else 1) + 1)
        if c == 7:
            cond = self.gen("b", d, True)
            x, y = self._operands(["i", r.choice(["i", "b"])], d, True)
            return Expr(f"torch.where({cond.src}, {x.src}, {y.src})", "i", max(x.bound, y.bound))
        if c == 8:
            x, y = self._operands(["i", "i"], d, True)
            if x.const or y.const:
                return None
            return Expr(f"{r.choice(['torch.minimum', 'torch.maximum'])}({x.src}, {y.src})", "i", max(x.bound, y.bound))
        x = self.gen(r.choice(["f", "b"]), d, True)  # casts: a float truncates toward zero
        if x.const:
            return None
        return Expr(f"({x.src}).to({r.choice(['torch.int32', 'torch.int64'])})", "i", x.bound + 1)

    def _bool(self, d: int, exact: bool):
        r = self.rng
        c = r.randrange(8)
        if c == 7:  # a tie: equal integers scaled by an inexact constant and compared (the diagonal of a
            # mask written on scaled positions); an FMA would round one product less and break it
            x, y = self._operands(["i", "i"], d, True)
            k = r.choice([0.1, 0.3, 0.7])
            return Expr(f"({x.src} * {k} {r.choice('+-')} 0.2 {r.choice(['<=', '>=', '=='])} {y.src} * {k} + 0.2)"
                        if r.random() < 0.5 else f"({x.src} * {k} - {y.src} * {k} {r.choice(['<=', '>='])} 0)", "b", 1)
        if c <= 2:  # comparisons of any two kinds
            x, y = self._operands([r.choice("fib"), r.choice("fi")], d, True)
            if x.const and y.const:
                return None
            op = r.choice(["<", "<=", ">", ">=", "==", "!="])
            return Expr(f"({x.src} {op} {y.src})", "b", 1)
        if c == 3:  # & | ^ ~ and torch's True + True / True * True on two booleans
            x, y = self._operands(["b", "b"], d, True)
            op = r.choice(["&", "|", "^", "+", "*"])
            return Expr(f"({x.src} {op} {y.src})", "b", 1)
        if c == 4:
            return Expr(f"(~{self.gen('b', d, True).src})", "b", 1)
        if c == 5:  # logical_* take nonzero-ness of any kind
            fn = r.choice(["torch.logical_and", "torch.logical_or", "torch.logical_xor"])
            x, y = self._operands([r.choice("fib"), r.choice("ib")], d, True)
            if x.const or y.const:
                return None
            return Expr(f"{fn}({x.src}, {y.src})", "b", 1)
        x = self.gen(r.choice("fib"), d, True)
        if x.const:
            return None
        return Expr(f"torch.logical_not({x.src})", "b", 1)


def draw(seed: int, count: int, mask: bool, device="cpu", **generator_kw):
    """count random (function, exact) pairs: score mods of mixed roots (each reads the score), or mask mods;
    their tables on `device`. generator_kw: Generator's options."""
    gen, ns = Generator(seed, with_score=not mask, **generator_kw), captured(seed, device)
    out = []
    for _ in range(count):
        kind = "b" if mask else gen.rng.choice("ffffib")
        e = gen.gen(kind, gen.rng.randint(1, 5))
        while kind == "i" and e.bound > gen.float_limit:  # (it is added to the score: a logit, bounded as floats are)
            e = gen.gen(kind, gen.rng.randint(1, 5))
        if not mask and "score" not in e.src:
            e = Expr(f"(score + {e.src})" if kind != "b" else f"torch.where({e.src}, score, -score)", "f", 0, e.exact)
        out.append((make_function(e.src, MASK_PARAMS if mask else SCORE_PARAMS, ns), e.exact))
    return out


def gpu_mods(seed: int, count: int, mask: bool, heads: int = 32) -> list:
    """Random modifiers, compiled, that a GPU kernel can be held to the reference on: no score under a step
    (the kernel's scores differ from the reference's in their last bits), integers bounded by a batch of 8,
    `heads` query heads and 4096 positions, logits within +-64; their tables on the GPU."""
    from attnforge.mods import compile_mod
    return [compile_mod(**{"mask_mod" if mask else "score_mod": fn}) for fn, _ in
            draw(seed, count, mask, device="cuda", steps_see_score=False, bounds=(8, heads, 4096), float_limit=64.0)]


def _python_number(src: str) -> bool:
    """Whether src, free of inputs, is folded by Python to a plain number."""
    try:
        return isinstance(eval(src, {"torch": torch}), (int, float, bool))  # noqa: S307 (test-generated source)
    except NameError:
        return False


def make_function(src: str, params: str, namespace: dict):
    """`def mod(<params>): return <src>` compiled against the captured tensors."""
    code = f"def mod({params}):\n    return {src}\n"
    ns = dict(namespace)
    exec(compile(code, "<random modifier>", "exec"), ns)  # noqa: S102 (test-generated source)
    ns["mod"].source = code
    return ns["mod"]
