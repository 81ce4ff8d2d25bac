"""Render Jinja CUDA templates (StrictUndefined: a missing variable is an error).

Also owns the kernel-parameter struct: one field list renders the C++ struct and builds
the matching ctypes.Structure, so host and device layouts cannot drift apart.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import jinja2

from .spec import FLOAT32_MAX

_HERE = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    # Source checkout: <repo>/templates; installed wheel: attnforge/_data/templates.
    for cand in (_HERE.parent / name, _HERE / "_data" / name):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(f"attnforge data folder '{name}' not found next to {_HERE}; "
                            "reinstall the package (pip install .).")


def templates_dir() -> Path:
    return _data_dir("templates")


def include_dir() -> Path:
    return _data_dir("csrc_include")


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              trim_blocks=True, lstrip_blocks=True, autoescape=False)


def render(template: str, context: dict) -> str:
    """Deterministic: the same context renders the same bytes."""
    return _env().get_template(template).render(**context)


_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "u32": ctypes.c_uint32,
           "i64": ctypes.c_int64, "f32": ctypes.c_float,
           "tmap": ctypes.c_uint64 * 16}  # a CUtensorMap (attnforge/jit/tma.py), packed from its 128 bytes
TMAP_ALIGN = 64  # the copy engine reads a tensor map from a 64-byte aligned address
_INT32_RANGES = {"i32": (-2 ** 31, 2 ** 31 - 1), "u32": (0, 2 ** 32 - 1)}


@dataclass(frozen=True)
class ParamField:
    name: str
    cpp_type: str  # what the kernel sees, e.g. "const nv_bfloat16*"
    kind: str  # one of _CTYPES: how the host packs it


class ParamsLayout:
    """A kernel's single by-value parameter struct."""

    MAX_TEMPLATES = 32

    def __init__(self, struct_name: str, fields: Sequence[ParamField]):
        bad = [f.kind for f in fields if f.kind not in _CTYPES]
        if bad:
            raise ValueError(f"unknown param kinds {bad}; allowed {sorted(_CTYPES)}")
        self.struct_name = struct_name
        self.fields = tuple(fields)
        self.has_tmap = any(f.kind == "tmap" for f in fields)
        layout = [(f.name, _CTYPES[f.kind]) for f in fields]
        if self.has_tmap:
            # The C++ struct is alignas(64) so a by-value map lands aligned; ctypes has no alignment
            # attribute before Python 3.13, so the maps go first and a tail pad rounds the size up.
            n_maps = sum(f.kind == "tmap" for f in fields)
            if any(f.kind != "tmap" for f in self.fields[:n_maps]):
                raise ValueError(f"{struct_name}: tensor-map fields must come first (64-byte alignment)")
            size = ctypes.sizeof(type("_probe", (ctypes.Structure,), {"_fields_": layout}))
            if size % TMAP_ALIGN:
                layout.append(("_tail_pad", ctypes.c_uint8 * (TMAP_ALIGN - size % TMAP_ALIGN)))
        self.ctype = type(struct_name, (ctypes.Structure,), {"_fields_": layout})
        self._names = frozenset(f.name for f in self.fields)
        self._tmap_names = tuple(f.name for f in self.fields if f.kind == "tmap")
        self._int32 = tuple((f.name, _INT32_RANGES[f.kind]) for f in self.fields if f.kind in _INT32_RANGES)
        self._f32 = tuple(f.name for f in self.fields if f.kind == "f32")
        self._templates: dict = {}  # (per-run names, fixed items) -> ParamsTemplate

    @property
    def size(self) -> int:
        return ctypes.sizeof(self.ctype)

    def cpp(self) -> str:
        body = "\n".join(f"  {f.cpp_type} {f.name};" for f in self.fields)
        align = f"alignas({TMAP_ALIGN}) " if self.has_tmap else ""
        return (f"struct {align}{self.struct_name} {{\n{body}\n}};\n"
                f"static_assert(sizeof({self.struct_name}) == {self.size}, "
                f"\"{self.struct_name}: host (ctypes) and device layouts disagree\");\n")

    def pack(self, **values) -> ctypes.Structure:
        if values.keys() != self._names:  # (the set difference only on failure: pack is on every run's path)
            missing, extra = self._names - values.keys(), values.keys() - self._names
            raise TypeError(f"{self.struct_name}: missing {sorted(missing)}, unexpected {sorted(extra)}")
        for name in self._tmap_names:  # the map's 128 bytes (attnforge.jit.tma.encode), or zeros when unused
            values[name] = _tmap(values[name])
        for name, (lo, hi) in self._int32:  # ctypes wraps an int past 32 bits silently: the kernel would get garbage
            if not lo <= values[name] <= hi:
                raise OverflowError(f"{self.struct_name}.{name} = {values[name]} does not fit the kernel's 32-bit "
                                    f"field [{lo}, {hi}]: an input past the kernels' 32-bit range that no check "
                                    f"caught; please report it with the call")
        for name in self._f32:  # a finite value past float32's range would arrive as inf (a scale of 1e39, say)
            if abs(values[name]) > FLOAT32_MAX and math.isfinite(values[name]):
                raise OverflowError(f"{self.struct_name}.{name} = {values[name]} does not fit the kernel's float32 "
                                    f"field: a scale or bound past float32's range that no check caught; please "
                                    f"report it with the call")
        return self.ctype(**values)

    def template(self, per_run: Sequence[str], **fixed) -> "ParamsTemplate":
        """A struct with the fields that stay fixed (a plan's) packed once; ParamsTemplate.fill sets the rest.
        Templates are kept by their values (a template is a function of them), so a step's plan whose fixed
        fields equal an earlier plan's (an engine's usual case: only the lengths changed) reuses its struct:
        building one costs ~10-15 us of Python on the run after each plan."""
        key = (tuple(per_run), tuple(fixed.items()))
        try:
            return self._templates[key]
        except KeyError:
            pass
        except TypeError:  # (an unhashable value: build without keeping it)
            return ParamsTemplate(self, per_run, fixed)
        if len(self._templates) >= self.MAX_TEMPLATES:  # (a long-running engine's plans repeat a few)
            self._templates.clear()
        template = self._templates[key] = ParamsTemplate(self, per_run, fixed)
        return template


def _tmap(raw):
    return _CTYPES["tmap"].from_buffer_copy(raw or bytes(128))


class ParamsTemplate:
    """A params struct packed once with a plan's fixed fields (wrappers build one at a plan's first run); each
    run copies it and sets only its own fields (pointers, strides, modifier values): ~2 us where packing
    all ~30 fields took ~15 us of Python on the run's path."""

    def __init__(self, layout: ParamsLayout, per_run: Sequence[str], fixed: dict):
        self.layout, self.per_run = layout, frozenset(per_run)
        if self.per_run & fixed.keys():
            both = sorted(self.per_run & fixed.keys())
            raise TypeError(f"{layout.struct_name}: fields both fixed and per run: {both}")
        self._tmaps = self.per_run & set(layout._tmap_names)
        self._struct = layout.pack(**fixed, **{n: None if n in self._tmaps else 0 for n in self.per_run})

    def fill(self, **values) -> ctypes.Structure:
        if values.keys() != self.per_run:
            raise TypeError(f"{self.layout.struct_name}: a run sets exactly {sorted(self.per_run)}, "
                            f"got {sorted(values)}")
        params = self.layout.ctype.from_buffer_copy(self._struct)  # (a copy: a launch may keep the last one)
        for name, value in values.items():
            setattr(params, name, _tmap(value) if name in self._tmaps else value)
        return params

    def narrowed(self, **values) -> "ParamsTemplate":
        """This template with `values` fixed too (a caller's tensors that repeat): its runs set only the rest."""
        if not values.keys() <= self.per_run:
            raise TypeError(f"{self.layout.struct_name}: only per-run fields can be fixed, got "
                            f"{sorted(values.keys() - self.per_run)}")
        narrow = object.__new__(ParamsTemplate)
        narrow.layout, narrow.per_run = self.layout, self.per_run - values.keys()
        narrow._tmaps = self._tmaps & narrow.per_run
        narrow._struct = self.layout.ctype.from_buffer_copy(self._struct)
        for name, value in values.items():
            setattr(narrow._struct, name, _tmap(value) if name in self._tmaps else value)
        return narrow
