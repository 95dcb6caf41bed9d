"""A tiny PNG writer (zlib + struct, no matplotlib): stacked bars of kept vs removed bytes per queue.

One horizontal bar per queue, in report order, scaled to the largest queue:
green is what is kept, red what retention removed. No text (no font here): the
JSON report and the stdout table list the queues in the same order.
"""

from __future__ import annotations

import struct
import zlib

KEPT = (46, 160, 67)
REMOVED = (214, 39, 40)
BACKGROUND = (255, 255, 255)
AXIS = (90, 90, 90)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(width: int, height: int, pixels: list[bytearray]) -> bytes:
    """RGB rows (``3 * width`` bytes each) as a PNG file."""
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def bar_chart(
    path: str, bars: list[tuple[str, int, int]], width: int = 640, bar_height: int = 18, gap: int = 6
) -> None:
    """Write ``bars`` ((label, kept bytes, removed bytes), labels unused) to ``path``."""
    margin = 10
    height = max(1, len(bars)) * (bar_height + gap) + 2 * margin
    rows = [bytearray(BACKGROUND * width) for _ in range(height)]
    largest = max((k + r for _, k, r in bars), default=0) or 1
    span = width - 2 * margin

    def fill(x0: int, x1: int, y0: int, y1: int, colour: tuple[int, int, int]) -> None:
        for y in range(max(0, y0), min(height, y1)):
            rows[y][3 * x0 : 3 * x1] = bytes(colour) * max(0, x1 - x0)

    for i, (_label, kept, removed) in enumerate(bars):
        y = margin + i * (bar_height + gap)
        kept_px = round(span * kept / largest)
        removed_px = round(span * removed / largest)
        fill(margin, margin + kept_px, y, y + bar_height, KEPT)
        fill(margin + kept_px, margin + kept_px + removed_px, y, y + bar_height, REMOVED)
    fill(margin - 1, margin, margin // 2, height - margin // 2, AXIS)
    with open(path, "wb") as f:
        f.write(encode_png(width, height, rows))
