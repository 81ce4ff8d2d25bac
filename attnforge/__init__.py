"""attnforge: a JIT-compiled, customizable GPU attention engine for LLM inference."""
__version__ = "0.1.0"

from .spec import AttentionSpec  # noqa: E402,F401
from .merge import merge_state, merge_states  # noqa: E402,F401

import logging as _logging

from .jit import env as _env

_log = _logging.getLogger("attnforge")
if not _log.handlers:  # one line per cold build goes to stderr unless the app configures logging
    _h = _logging.StreamHandler()
    _h.setFormatter(_logging.Formatter("%(message)s"))
    _log.addHandler(_h)
    _log.setLevel(_env.LOG_LEVEL.value)
    _log.propagate = False

from .decode import BatchDecode  # noqa: E402,F401
from .mla import BatchMLADecode  # noqa: E402,F401
from .append import append_kv_by_slots, append_paged_kv_cache, append_paged_mla_kv_cache  # noqa: E402,F401
from .prefill import BatchPrefill, single_prefill  # noqa: E402,F401
from .dense import attention  # noqa: E402,F401
from .dense_decode import single_decode  # noqa: E402,F401
from . import mods  # noqa: E402,F401
from .jit.registry import OccupancyWarning  # noqa: E402,F401
