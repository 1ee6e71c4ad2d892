"""Fresh output tensors for merges: large CPU outputs on 2 MiB pages, and in a stream, the memory of the last one again.

A merged layer is written once into a tensor allocated for it. glibc (under torch's CPU allocator) maps every block
of 32 MiB or more afresh from the OS and unmaps it when freed, so a large output is faulted in 4 KiB page by 4 KiB
page while the merge writes it, which costs several times the merge itself. Asking for transparent huge pages (as
PyTorch's THP_MEM_ALLOC_ENABLE=1 does for every allocation) takes one fault per 2 MiB instead; what is left is the
kernel zeroing each new page. A stream of merges (`iter_merged_weights`) goes further: its consumer usually copies a
tensor out (into a transfer bucket, into the engine's parameters) and drops it, so a later large output reuses that
memory, already faulted in. Smaller outputs stay with torch: glibc reuses freed heap memory for them, with no fault at
all.
"""

import contextlib
import math
import mmap
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
MAPPED_AFRESH_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit: blocks this large are always mapped anew
HAS_HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE")  # Linux; elsewhere outputs are torch's


class OutputMemory:
    """Allocates the outputs of a stream of merges, keeping at most two memory regions of its own: a consumer that
    iterates `for name, tensor in stream` still holds the last tensor while the next one is merged, so the memory that
    is free again by then is that of the one before. A region is reused only once no tensor uses it (a consumer that
    holds on to more tensors just gets new memory, as without reuse). For a loop like that the peak is unchanged:
    the free region kept is what the next merge would allocate while the loop still holds the last tensor, and one
    too small for it is unmapped first."""

    kept_regions = 2

    def __init__(self) -> None:
        self._regions: list[mmap.mmap] = []

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor for a merge to write, on 2 MiB pages where it is large and on the CPU."""
        numel = math.prod(shape)
        if not HAS_HUGE_PAGES or torch.device(device).type != "cpu" or numel * dtype.itemsize < MAPPED_AFRESH_BYTES:
            return torch.empty(shape, dtype=dtype, device=device)
        size = numel * dtype.itemsize + HUGE_PAGE_BYTES  # slack to align the tensor to a huge page
        unused = self._unused()
        fitting = [i for i in unused if len(self._regions[i]) >= size]
        if fitting:
            region = self._regions[fitting[0]]
        else:  # free regions are too small: unmapped now, before a new one is faulted in
            in_use = [region for i, region in enumerate(self._regions) if i not in unused]
            region = huge_page_region(size)
            self._regions = [*in_use[1 - self.kept_regions :], region]  # older ones in use: the consumer's alone
        offset = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE_BYTES
        return torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(shape)

    def _unused(self) -> list[int]:
        # Each tensor storage made from a region holds a reference to it until the storage is freed; an unused
        # region has two: this object's list and getrefcount's own argument.
        return [i for i in range(len(self._regions)) if sys.getrefcount(self._regions[i]) == 2]


def huge_page_region(size: int) -> mmap.mmap:
    """Private anonymous memory advised for transparent huge pages (a shared mapping would be shmem, which THP leaves
    alone). Each tensor made from it holds it; it is unmapped once nothing references it."""
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    with contextlib.suppress(OSError):  # a kernel built without THP: 4 KiB pages, as torch's
        region.madvise(mmap.MADV_HUGEPAGE)
    return region


def empty_output(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A single merge's output (`merge_lora` without `out`): on 2 MiB pages where large, nothing reused."""
    return OutputMemory().empty(shape, dtype, device)
