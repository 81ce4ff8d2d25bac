"""Load cubins through the CUDA driver API (cuda-python) and launch on torch's stream.

Every CUresult is checked and turned into CudaDriverError naming the call.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch


class CudaDriverError(RuntimeError):
    pass


@lru_cache(maxsize=1)
def driver():
    try:
        from cuda.bindings import driver as drv
    except ImportError:  # cuda-python < 12.6 spelled it differently
        try:
            from cuda import cuda as drv
        except ImportError:
            raise ImportError("cuda-python is required to launch kernels: pip install cuda-python") from None
    return drv


def check(result, call: str):
    """cuda-python returns (CUresult, *values); raise unless CUDA_SUCCESS."""
    drv = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        _, text = drv.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else name
        text = text.decode() if isinstance(text, bytes) else text
        raise CudaDriverError(f"{call} failed: {name}: {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _failed(result) -> bool:
    """Whether a driver call's result (a (CUresult, ...) tuple, or a bare CUresult) is an error (check() then says
    which)."""
    return (result[0] if isinstance(result, tuple) else result) != driver().CUresult.CUDA_SUCCESS


_ctx_lock = threading.Lock()


_retained: dict = {}  # device index -> its primary context, retained once (torch holds it for the process too)


def _primary(index: int):
    """The device's primary context (the one torch uses), retained at its first request (callers hold _ctx_lock)."""
    primary = _retained.get(index)
    if primary is None:
        drv = driver()
        dev = check(drv.cuDeviceGet(index), "cuDeviceGet")
        primary = _retained[index] = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    return primary


def _has_context(drv) -> bool:
    ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    return ctx is not None and int(ctx) != 0


def ensure_context(device: torch.device) -> None:
    """Make torch's primary context current in this thread.

    Driver calls fail with CUDA_ERROR_INVALID_CONTEXT until a context is current, and torch
    creates its own lazily, so retain the same primary context and set it current ourselves.
    """
    drv = driver()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _ctx_lock:
        check(drv.cuInit(0), "cuInit")
        if _has_context(drv):
            return
        if index != torch.cuda.current_device():
            # Another device than torch's current one: torch's own switch creates the context (cudaSetDevice) and
            # its switch back is lazy where the first device has no context yet, so this one stays current for the
            # driver while torch's current device stays as it was. Setting it here would move torch's device too.
            with torch.cuda.device(index):
                pass
            if _has_context(drv):
                return
        check(drv.cuCtxSetCurrent(_primary(index)), "cuCtxSetCurrent")


@contextlib.contextmanager
def device_context(device: torch.device):
    """Run the driver calls inside in `device`'s primary context. A CUfunction belongs to the context current when
    it is looked up (cuKernelGetFunction), and a launch on another device's stream fails with it, so a library for
    cuda:1 must be loaded in cuda:1's context even while torch's current device is 0. Where another device's context,
    or none, is current, the primary context is pushed for the block and popped after, so torch's current device
    never changes behind its back."""
    drv = driver()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _ctx_lock:
        check(drv.cuInit(0), "cuInit")
        if _has_context(drv) and int(check(drv.cuCtxGetDevice(), "cuCtxGetDevice")) == index:
            primary = None  # (already the device's context: nothing to push)
        else:
            primary = _primary(index)
            check(drv.cuCtxPushCurrent(primary), "cuCtxPushCurrent")
    try:
        yield
    finally:
        if primary is not None:
            check(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")


def _raw_stream_getter():
    # torch's private getter (what its own compiler emits for launches) returns the handle as an int in
    # ~0.2 us; the public torch.cuda.current_stream() builds a Stream object: 3-5 us per call on the GPU
    # hosts measured (tools/plan_gpu_cost.py), paid by every plan() and every launch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


_current_raw_stream = None


def current_stream_handle(device_index: Optional[int] = None) -> int:
    """torch's current CUDA stream on a device (default: the current one), as a raw handle."""
    global _current_raw_stream
    if _current_raw_stream is None:
        _current_raw_stream = _raw_stream_getter()
    return _current_raw_stream(torch.cuda.current_device() if device_index is None else device_index)


_ALREADY_CURRENT = contextlib.nullcontext()
_thread = threading.local()  # .has_context: this thread made a context current once (the driver's is per thread)


def on_device(device: torch.device):
    """torch.cuda.device(device) around a launch, or a no-op where `device` is already torch's current device
    (the common case): the guard's switch and switch back cost 1.8-3.5 us of host time a run on the H200 hosts
    (tools/launch_cost.py), the check ~0.4. The same effect either way: torch's guard changes nothing then.
    A thread's first call makes a context current: a new thread has none for the driver until torch's runtime
    binds one, and a plan made in a worker thread may be its first CUDA work."""
    if device.index is not None and torch.cuda.current_device() == device.index:
        if not getattr(_thread, "has_context", False):
            ensure_context(device)
            _thread.has_context = True
        return _ALREADY_CURRENT
    return torch.cuda.device(device)


# Kernels that call wait_for_prior_grid() before reading what the kernel before them writes, and write
# nothing before it (their templates; tests/jit/test_pdl.py checks what each reads before the wait):
# only these may be launched with pdl=True.
PDL_KERNELS = frozenset({"batch_decode_kernel", "batch_decode_merge_kernel", "mla_decode_kernel", "mla_merge_kernel",
                         "mla_merge_one_wave_kernel", "quest_score_kernel", "quest_select_kernel"})


@lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def pdl_supported(device_index: Optional[int] = None) -> bool:
    """Programmatic dependent launch needs sm_90 or newer. Elsewhere a pdl=True launch is an ordinary
    one: the kernels' griddepcontrol instructions are compiled only for sm_90+ (attnforge/common.cuh),
    so nothing in them depends on the attribute."""
    return _capability_major(torch.cuda.current_device() if device_index is None else device_index) >= 9


class LoadedKernel:
    def __init__(self, library_name: str, name: str, function, device: Optional[torch.device] = None,
                 dynamic_smem_limit: int = 48 * 1024):
        self.library_name, self.name, self.function = library_name, name, function
        self.device = device  # (the function's own: occupancy queries run in its context)
        # dynamic shared memory a launch may take without the opt-in attribute: 48 KB less the kernel's static
        # __shared__ variables (the driver's own value, read at load: LoadedLibrary). Taking 48 KB of dynamic
        # memory beside 4 static bytes fails with CUDA_ERROR_INVALID_VALUE unless the attribute is raised first.
        self._smem_limit = dynamic_smem_limit
        self._pdl_configs: dict[tuple, object] = {}  # (grid, block, smem, stream) -> CUlaunchConfig
        self._pdl_ok: Optional[bool] = None  # pdl_supported() on this kernel's device, asked at its first PDL launch

    def _pdl_config(self, grid, block, smem: int, handle: int):
        """The launch's PDL config, built once per shape and stream (3-4 us of cuda-python objects a launch);
        the driver reads it during the call, so one object serves every launch with these values."""
        key = (grid, block, smem, handle)
        config = self._pdl_configs.get(key)
        if config is None:
            if len(self._pdl_configs) >= 64:  # (a plan's grid changes with its batch only where planned so)
                self._pdl_configs.clear()
            config = self._pdl_configs[key] = pdl_launch_config(grid, block, smem, handle)
        return config

    def _allow_smem(self, smem: int) -> None:
        """Let the kernel take `smem` bytes of dynamic shared memory (past the limit read at load)."""
        drv = driver()
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(drv.cuFuncSetAttribute(self.function, attr, smem), f"cuFuncSetAttribute({self.name}, {smem} B)")
        # Prefer the largest shared-memory carveout so several such CTAs fit on one SM.
        carve = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        check(drv.cuFuncSetAttribute(self.function, carve, 100), f"cuFuncSetAttribute({self.name}, carveout)")
        self._smem_limit = max(self._smem_limit, smem)

    def max_active_ctas(self, threads: int, smem: int) -> int:
        """CTAs of `threads` threads with `smem` bytes of dynamic shared memory that one SM of the current
        device holds at once: the driver's occupancy calculator, over the cubin's registers as loaded."""
        with device_context(self.device) if self.device is not None else contextlib.nullcontext():
            if smem > self._smem_limit:
                self._allow_smem(smem)
            return int(check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, threads, smem),
                             f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name}, {threads} threads, {smem} B)"))

    def launch(self, grid, block, params: ctypes.Structure, smem: int = 0, stream=None, pdl: bool = False) -> None:
        """Launch with one by-value params struct on torch's current stream (graph-capturable).

        pdl: programmatic dependent launch, for a kernel that follows one of ours in the stream and calls
        wait_for_prior_grid() (attnforge/common.cuh) before reading that kernel's output: its CTAs may
        be placed while the previous kernel finishes, hiding the launch gap (a programmatic edge when
        captured in a CUDA graph)."""
        if pdl and self.name not in PDL_KERNELS:
            raise ValueError(f"{self.name}: a PDL launch needs a kernel that waits for the prior grid first "
                             f"(expected one of loader.PDL_KERNELS {sorted(PDL_KERNELS)}, got {self.name!r}); "
                             f"launch it with pdl=False, or make wait_for_prior_grid() (attnforge/common.cuh) its "
                             f"first statement and add it to PDL_KERNELS")
        if pdl and self._pdl_ok is None:
            self._pdl_ok = pdl_supported()
        pdl = pdl and self._pdl_ok
        drv = driver()
        if smem > self._smem_limit:
            self._allow_smem(smem)
        handle = current_stream_handle() if stream is None else getattr(stream, "cuda_stream", stream)
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        if gx * gy * gz == 0:
            return  # an empty grid is a valid no-op, not a driver error
        arg_ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        # (the error's text is built only on failure: this is every launch's path)
        if pdl:
            config = self._pdl_config((gx, gy, gz), (bx, by, bz), smem, handle)
            result = drv.cuLaunchKernelEx(config, self.function, ctypes.addressof(arg_ptrs), 0)
            if _failed(result):
                check(result, f"cuLaunchKernelEx({self.name}, grid={(gx, gy, gz)}, block={(bx, by, bz)}, "
                              f"smem={smem}, PDL)")
            return
        result = drv.cuLaunchKernel(self.function, gx, gy, gz, bx, by, bz, smem, drv.CUstream(handle),
                                    ctypes.addressof(arg_ptrs), 0)
        if _failed(result):
            check(result, f"cuLaunchKernel({self.name}, grid={(gx, gy, gz)}, block={(bx, by, bz)}, smem={smem})")


def pdl_launch_config(grid, block, smem: int, stream_handle: int):
    """A CUlaunchConfig with programmatic stream serialization allowed (built without a GPU: tested)."""
    drv = driver()
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = drv.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem
    config.hStream = drv.CUstream(stream_handle)
    config.attrs = [attr]
    config.numAttrs = 1
    return config


def dynamic_smem_limit(function) -> int:
    """The dynamic shared memory (bytes) `function` may take before its opt-in attribute is raised: the driver's
    value, and never past 48 KB less the function's static __shared__ variables (a block's static and dynamic
    memory share the 48 KB a launch gets without opting in)."""
    drv = driver()
    attrs = drv.CUfunction_attribute
    allowed = check(drv.cuFuncGetAttribute(attrs.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, function),
                    "cuFuncGetAttribute(max dynamic shared memory)")
    static = check(drv.cuFuncGetAttribute(attrs.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function),
                   "cuFuncGetAttribute(static shared memory)")
    return min(int(allowed), 48 * 1024 - int(static))


class LoadedLibrary:
    """One cubin/fatbin loaded into the current context, with its kernels looked up once."""

    def __init__(self, path: Path, kernel_names: tuple[str, ...], device: torch.device):
        drv = driver()
        self.path = path
        self._data = path.read_bytes()  # the driver may keep a pointer: keep the bytes alive
        self.kernels: dict[str, LoadedKernel] = {}
        with device_context(device):  # (each function handle is the device's own: see device_context)
            self.library = check(drv.cuLibraryLoadData(self._data, None, None, 0, None, None, 0),
                                 f"cuLibraryLoadData({path})")
            for name in kernel_names:
                k = check(drv.cuLibraryGetKernel(self.library, name.encode()), f"cuLibraryGetKernel({name})")
                f = check(drv.cuKernelGetFunction(k), f"cuKernelGetFunction({name})")
                self.kernels[name] = LoadedKernel(path.name, name, f, device, dynamic_smem_limit(f))

    def __getitem__(self, name: str) -> LoadedKernel:
        return self.kernels[name]
