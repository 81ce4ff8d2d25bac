"""KV-cache memory: a vAttention-style virtual-contiguous cache on CUDA virtual memory."""
from .vmm import CudaVMM, OutOfPhysicalMemory, VirtualKVCache, paged_bytes  # noqa: F401
