"""Per-kernel resources read from a cubin, without a GPU or the CUDA tools.

ptxas records each function's register count and stack frame in the ELF image's `.nv.info` section
(EIATTR_REGCOUNT, EIATTR_FRAME_SIZE: a symbol index and a 32-bit value each), and its static shared memory as
the size of a section `.nv.shared.<function>` (with sm_90's reserved 1 KB). The planners size persistent grids
as SMs x CTAs per SM from shared memory; the register count says whether that many CTAs really fit, and a
non-zero frame means local memory (spills) in a hot loop.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

_EIATTR_FRAME_SIZE, _EIATTR_REGCOUNT = 0x11, 0x2F
_EIFMT_SVAL = 4  # u16 size, then `size` bytes; every other format is a 4-byte entry
_SHT_SYMTAB = 2
REGISTERS_PER_SM = 65536
_REG_ALLOC_UNIT = 256  # registers are allocated per warp in blocks of 256


@dataclass(frozen=True)
class KernelResources:
    registers: int  # per thread
    frame_bytes: int  # per-thread stack frame: local memory, spills included
    # the size of the function's .nv.shared section: its static __shared__ variables (padded to 128 bytes), after
    # the 1 KB a CTA's shared memory reserves for the system on sm_90. With the launch's dynamic bytes, what a CTA
    # takes of the SM's shared memory
    shared_section_bytes: int = 0

    def ctas_by_registers(self, threads: int) -> int:
        """CTAs of `threads` threads one SM's register file holds."""
        per_warp = -(-self.registers * 32 // _REG_ALLOC_UNIT) * _REG_ALLOC_UNIT
        return REGISTERS_PER_SM // (-(-threads // 32) * per_warp)


def kernel_resources(image: bytes) -> dict[str, KernelResources]:
    """{function name: resources} for every function the image's .nv.info describes."""
    if image[:4] != b"\x7fELF" or image[4] != 2:
        raise ValueError("kernel_resources: expected a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]

    def cstr(table: int, offset: int) -> str:
        start = sections[table][4] + offset
        return image[start:image.index(b"\0", start)].decode()

    names: dict[int, str] = {}
    for sec in sections:
        if sec[1] == _SHT_SYMTAB:
            for k in range(sec[5] // 24):  # Elf64_Sym: name u32, info u8, other u8, shndx u16, value, size
                names[k] = cstr(sec[6], struct.unpack_from("<I", image, sec[4] + 24 * k)[0])
    regs: dict[int, int] = {}
    frames: dict[int, int] = {}
    for sec in sections:
        if cstr(shstrndx, sec[0]) != ".nv.info":
            continue
        pos, end = sec[4], sec[4] + sec[5]
        while pos < end:
            fmt, attr = image[pos], image[pos + 1]
            if fmt != _EIFMT_SVAL:
                pos += 4
                continue
            size, = struct.unpack_from("<H", image, pos + 2)
            if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and size == 8:
                sym, value = struct.unpack_from("<II", image, pos + 4)
                (regs if attr == _EIATTR_REGCOUNT else frames)[sym] = value
            pos += 4 + size
    prefix = ".nv.shared."  # (NOBITS sections: the size is the allocation, no bytes in the image)
    shared = {cstr(shstrndx, sec[0])[len(prefix):]: sec[5] for sec in sections
              if cstr(shstrndx, sec[0]).startswith(prefix)}
    resources = {}
    for sym, n in regs.items():
        name = names.get(sym, f"#{sym}")
        resources[name] = KernelResources(n, frames.get(sym, 0), shared.get(name, 0))
    return resources
