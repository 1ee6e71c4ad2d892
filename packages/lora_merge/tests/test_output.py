"""Fresh outputs of large CPU merges live on memory advised for 2 MiB pages (`lorarl.lora_merge._output`): they hold
the merge's values, the memory lives as long as the tensor (and its views), a stream reuses it only once no tensor
uses it, and other outputs are torch's."""

import gc
import sys

import pytest
import torch
from merge_reference import assert_merged_close

from lorarl.lora_merge import merge_lora
from lorarl.lora_merge._output import HAS_HUGE_PAGES, HUGE_PAGE_BYTES, MAPPED_AFRESH_BYTES, OutputMemory, empty_output

CPU = torch.device("cpu")
LARGE = (MAPPED_AFRESH_BYTES // 4,)  # float32 elements
with_huge_pages = pytest.mark.skipif(  # reads /proc/self/smaps; outputs are torch's where THP is unknown
    not (sys.platform.startswith("linux") and HAS_HUGE_PAGES), reason="Linux with transparent huge pages"
)


def mappings() -> dict[tuple[int, int], set[str]]:
    """This process's memory mappings, (start, end) -> the kernel's VmFlags ("hg": advised for huge pages)."""
    found, span = {}, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                span = tuple(int(x, 16) for x in head.split("-"))
            elif head == "VmFlags:":
                found[span] = set(line.split()[1:])
    return found


def mapping_of(address: int) -> tuple[tuple[int, int], set[str]]:
    [(span, flags)] = [(span, flags) for span, flags in mappings().items() if span[0] <= address < span[1]]
    return span, flags


@with_huge_pages
def test_a_large_merge_without_out_is_written_to_memory_advised_for_huge_pages():
    weight = torch.randn(2048, 8192, generator=torch.Generator().manual_seed(3)).bfloat16()  # 32 MiB
    generator = torch.Generator().manual_seed(4)
    lora_A, lora_B = torch.randn(8, 8192, generator=generator), torch.randn(2048, 8, generator=generator)
    merged = merge_lora(weight, lora_A, lora_B, 0.5)
    assert merged.nbytes == MAPPED_AFRESH_BYTES
    assert merged.is_contiguous()
    assert merged.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in mapping_of(merged.data_ptr())[1]
    gc.collect()
    assert_merged_close(merged, weight, lora_A, lora_B, 0.5)


@with_huge_pages
def test_the_memory_lives_as_long_as_the_tensor_or_a_view_of_it():
    out = empty_output((LARGE[0] + 1,), torch.float32, CPU)
    out.fill_(2.0)
    view = out[1:]
    span, _ = mapping_of(view.data_ptr())
    del out
    gc.collect()
    assert view.sum().item() == 2.0 * view.numel()  # still mapped, still holding what was written
    del view
    gc.collect()
    assert span not in mappings()  # unmapped with the last view


def test_small_and_non_cpu_outputs_are_plain_torch_tensors():
    small = empty_output((7, 5), torch.bfloat16, CPU)
    assert (small.shape, small.dtype, small.device) == ((7, 5), torch.bfloat16, CPU)
    large_meta = empty_output((MAPPED_AFRESH_BYTES, 2), torch.float32, torch.device("meta"))
    assert (large_meta.shape, large_meta.device.type) == ((MAPPED_AFRESH_BYTES, 2), "meta")


@with_huge_pages
def test_a_stream_reuses_the_memory_of_an_output_no_tensor_uses_any_more():
    outputs = OutputMemory()
    first = outputs.empty(LARGE, torch.float32, CPU).fill_(1.0)
    second = outputs.empty(LARGE, torch.float32, CPU).fill_(2.0)  # the first is still held: new memory
    assert second.data_ptr() != first.data_ptr()
    first_address = first.data_ptr()
    del first
    third = outputs.empty(LARGE, torch.float32, CPU).fill_(3.0)
    assert third.data_ptr() == first_address
    assert (second == 2.0).all()


@with_huge_pages
def test_a_view_keeps_the_memory_in_use():
    outputs = OutputMemory()
    first = outputs.empty(LARGE, torch.float32, CPU).fill_(1.0)
    view = first[1:]
    del first
    second = outputs.empty(LARGE, torch.float32, CPU).fill_(2.0)
    third = outputs.empty(LARGE, torch.float32, CPU).fill_(3.0)  # the view still uses the first's memory
    assert len({view.data_ptr() - 4, second.data_ptr(), third.data_ptr()}) == 3
    assert (view == 1.0).all()
    assert (second == 2.0).all()


@with_huge_pages
def test_free_memory_too_small_for_the_next_output_is_unmapped():
    outputs = OutputMemory()
    small = outputs.empty(LARGE, torch.float32, CPU)
    span, _ = mapping_of(small.data_ptr())
    del small
    larger = outputs.empty((2 * LARGE[0],), torch.float32, CPU)
    assert span not in mappings()
    assert "hg" in mapping_of(larger.data_ptr())[1]
