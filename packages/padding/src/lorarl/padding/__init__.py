"""Padded ↔ packed ↔ jagged batches, and response-aligned per-token values correct for every padding layout."""

from lorarl.padding.batch import LeftRightBatch, left_right_pad
from lorarl.padding.nested import from_nested, to_nested
from lorarl.padding.packing import Packed, packed_position_ids, pad, segments, token_positions, unpad
from lorarl.padding.response import response_from_packed, response_from_padded

__all__ = [
    "LeftRightBatch",
    "Packed",
    "from_nested",
    "left_right_pad",
    "packed_position_ids",
    "pad",
    "response_from_packed",
    "response_from_padded",
    "segments",
    "to_nested",
    "token_positions",
    "unpad",
]
