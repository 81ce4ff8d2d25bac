"""JIT pipeline: env knobs -> arch/toolchain -> content-hashed ninja build -> driver loader."""
from .builder import JitBuildError, JitModule, MissingModuleError, build, build_many  # noqa: F401
