"""The path tracer's environment image: reading and writing Radiance .hdr (RGBE) and PFM files,
and ``EnvironmentMap``, an equirectangular radiance map with its importance-sampling tables.

Directions map to the image by z up: row r covers polar angles theta in [r, r + 1) pi / H from
+z (row 0 the zenith), column c azimuths phi = atan2(y, x) in [c, c + 1) 2 pi / W - pi (column 0
at -x, turning toward -y). ``EnvironmentMap.words`` lays the map and its tables out as the
float32 words that runtime/path_tracing.py's light data carries to both walkers (the twin's
kernel and shaders/path.wgsl read the same words).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .tape import TaperayError

__all__ = ["EnvironmentMap", "read_environment", "read_hdr", "read_pfm", "write_hdr", "write_pfm"]

MAX_WORDS = 1 << 23      # the light data's offsets are float32 words: exact integers, with room
_RES = re.compile(rb"^([-+])Y\s+(\d+)\s+([-+])X\s+(\d+)$")


def read_environment(path) -> np.ndarray:
    """(H, W, 3) float32 linear radiance of a .hdr / .pic (Radiance RGBE) or .pfm file."""
    p = Path(path)
    if not p.is_file():
        raise TaperayError(f"{p}: no such environment image")
    suffix = p.suffix.lower()
    if suffix in (".hdr", ".pic"):
        return read_hdr(p)
    if suffix == ".pfm":
        return read_pfm(p)
    raise TaperayError(f"{p}: an environment image must be a .hdr (Radiance RGBE) or .pfm file")


def read_hdr(path) -> np.ndarray:
    """(H, W, 3) float32 of a Radiance RGBE file (flat or run-length encoded scanlines)."""
    p = Path(path)
    data = p.read_bytes()
    if not (data.startswith(b"#?RADIANCE") or data.startswith(b"#?RGBE")):
        raise TaperayError(f"{p}: not a Radiance .hdr file (no #?RADIANCE line)")
    pos, fmt = 0, None
    while True:
        end = data.find(b"\n", pos)
        if end < 0:
            raise TaperayError(f"{p}: the header has no end (an empty line)")
        line = data[pos:end].strip()
        pos = end + 1
        if not line:
            break
        if line.startswith(b"FORMAT="):
            fmt = line[7:]
    if fmt not in (None, b"32-bit_rle_rgbe"):
        raise TaperayError(f"{p}: format {fmt.decode(errors='replace')} is not supported (32-bit_rle_rgbe only)")
    end = data.find(b"\n", pos)
    m = _RES.match(data[pos:end if end >= 0 else len(data)].strip())
    if m is None:
        raise TaperayError(f"{p}: the resolution line is not '-Y H +X W'")
    h, w = int(m.group(2)), int(m.group(4))
    if h < 1 or w < 1:
        raise TaperayError(f"{p}: image size {w}x{h} must be at least 1x1")
    rgbe = _scanlines(data, end + 1, w, h, p)
    if m.group(1) == b"+":
        rgbe = rgbe[::-1]
    if m.group(3) == b"-":
        rgbe = rgbe[:, ::-1]
    e = rgbe[..., 3].astype(np.int32)
    scale = np.where(e > 0, np.ldexp(1.0, e - 136), 0.0)
    return ((rgbe[..., :3].astype(np.float64) + 0.5) * scale[..., None]).astype(np.float32)


def _scanlines(data: bytes, pos: int, w: int, h: int, p: Path) -> np.ndarray:
    """(H, W, 4) uint8 RGBE of the pixel data from byte ``pos``."""
    buf = np.frombuffer(data, np.uint8)
    out = np.empty((h, w, 4), np.uint8)
    for row in range(h):
        rle = 8 <= w < 0x8000 and pos + 4 <= len(buf) and buf[pos] == 2 and buf[pos + 1] == 2 and buf[pos + 2] < 128
        if not rle:          # flat: the rest of the file as RGBE quadruples
            need = (h - row) * w * 4
            if pos + need > len(buf):
                raise TaperayError(f"{p}: the pixel data ends early (row {row} of {h})")
            out[row:] = buf[pos:pos + need].reshape(h - row, w, 4)
            return out
        if (int(buf[pos + 2]) << 8 | int(buf[pos + 3])) != w:
            raise TaperayError(f"{p}: row {row}'s run-length header says another width than {w}")
        pos += 4
        for c in range(4):
            x = 0
            while x < w:
                if pos >= len(buf):
                    raise TaperayError(f"{p}: the pixel data ends early (row {row} of {h})")
                n = int(buf[pos])
                pos += 1
                if n > 128:
                    n -= 128
                    if x + n > w or pos >= len(buf):
                        raise TaperayError(f"{p}: row {row}: a run passes the row's end")
                    out[row, x:x + n, c] = buf[pos]
                    pos += 1
                else:
                    if n == 0 or x + n > w or pos + n > len(buf):
                        raise TaperayError(f"{p}: row {row}: a bad run length")
                    out[row, x:x + n, c] = buf[pos:pos + n]
                    pos += n
                x += n
    return out


def write_hdr(path, rgb) -> Path:
    """Write (H, W, 3) linear radiance >= 0 as a Radiance RGBE file (run-length encoded rows)."""
    a = np.asarray(rgb, np.float64)
    if a.ndim != 3 or a.shape[2] != 3:
        raise TaperayError(f"write_hdr: the image must be (H, W, 3), got {a.shape}")
    h, w, _ = a.shape
    top = a.max(-1)
    mant, e = np.frexp(top)
    keep = top >= 1e-32
    scale = np.where(keep, mant * 256.0 / np.where(keep, top, 1.0), 0.0)
    rgbe = np.zeros((h, w, 4), np.uint8)
    rgbe[..., :3] = np.clip(np.floor(a * scale[..., None]), 0, 255).astype(np.uint8)
    rgbe[..., 3] = np.where(keep, e + 128, 0).astype(np.uint8)
    out = bytearray(b"#?RADIANCE\nFORMAT=32-bit_rle_rgbe\n\n" + f"-Y {h} +X {w}\n".encode())
    for row in range(h):
        if not 8 <= w < 0x8000:
            out += rgbe[row].tobytes()
            continue
        out += bytes((2, 2, w >> 8, w & 255))
        for c in range(4):
            out += _rle(rgbe[row, :, c])
    p = Path(path)
    p.write_bytes(bytes(out))
    return p


def _rle(v: np.ndarray) -> bytes:
    """One channel of a row in the new RLE: runs of >= 3 equal bytes, literals otherwise."""
    out, x, n = bytearray(), 0, len(v)
    while x < n:
        run = 1
        while x + run < n and run < 127 and v[x + run] == v[x]:
            run += 1
        if run >= 3:
            out += bytes((128 + run, int(v[x])))
            x += run
            continue
        end = x
        while end < n and end - x < 128 and not (end + 2 < n and v[end] == v[end + 1] == v[end + 2]):
            end += 1
        out += bytes((end - x,)) + v[x:end].tobytes()
        x = end
    return bytes(out)


def read_pfm(path) -> np.ndarray:
    """(H, W, 3) float32 of a PFM file ("PF" colour or "Pf" grey, rows bottom to top)."""
    p = Path(path)
    data = p.read_bytes()
    parts = data.split(maxsplit=4)
    if len(parts) < 4 or parts[0] not in (b"PF", b"Pf"):
        raise TaperayError(f"{p}: not a PFM file (no PF / Pf line)")
    try:
        w, h, scale = int(parts[1]), int(parts[2]), float(parts[3])
    except ValueError:
        raise TaperayError(f"{p}: the PFM header's size or scale is not a number") from None
    ch = 3 if parts[0] == b"PF" else 1
    # the pixel data follows the single whitespace byte after the scale
    head = data.index(parts[3], len(parts[0]) + len(parts[1]) + len(parts[2])) + len(parts[3]) + 1
    need = w * h * ch * 4
    if w < 1 or h < 1 or len(data) - head < need:
        raise TaperayError(f"{p}: the PFM pixel data ({len(data) - head} bytes) is short of {w}x{h}x{ch} floats")
    a = np.frombuffer(data, "<f4" if scale < 0 else ">f4", w * h * ch, head).reshape(h, w, ch)[::-1]
    return np.ascontiguousarray(np.repeat(a, 3 // ch, axis=2), np.float32)


def write_pfm(path, rgb) -> Path:
    """Write (H, W, 3) float32 as a little-endian colour PFM."""
    a = np.asarray(rgb, np.float32)
    if a.ndim != 3 or a.shape[2] != 3:
        raise TaperayError(f"write_pfm: the image must be (H, W, 3), got {a.shape}")
    p = Path(path)
    p.write_bytes(f"PF\n{a.shape[1]} {a.shape[0]}\n-1.0\n".encode() + a[::-1].astype("<f4").tobytes())
    return p


class EnvironmentMap:
    """An equirectangular radiance map (H, W, 3), linear, finite and >= 0 (``source``: its
    file, for messages), and its sampling tables: the marginal CDF over rows and each row's
    conditional CDF over columns, of the pixels' mean radiance times sin(theta) at the row's
    centre (a row or map of zero weight: uniform)."""

    def __init__(self, radiance, source: str = "environment map"):
        a = np.asarray(radiance, np.float32)
        if a.ndim != 3 or a.shape[2] != 3 or a.shape[0] < 1 or a.shape[1] < 1:
            raise TaperayError(f"{source}: an environment map must be (H, W, 3), got {a.shape}")
        if not np.all(np.isfinite(a)) or np.any(a < 0):
            raise TaperayError(f"{source}: the environment map holds values that are not finite or < 0")
        h, w = a.shape[:2]
        if 4 * h * w + 2 * h + 1 > MAX_WORDS:
            raise TaperayError(f"{source}: a {w}x{h} environment map is too large (its tables exceed {MAX_WORDS} "
                               "words: at most about 2048x1024)")
        self.radiance = np.ascontiguousarray(a)
        self.source = source
        sin = np.sin((np.arange(h) + 0.5) / h * np.pi)
        weight = a.astype(np.float64).mean(-1) * sin[:, None]
        rows = weight.sum(1)
        cond = np.where(rows[:, None] > 0, weight / np.where(rows > 0, rows, 1)[:, None], 1.0 / w)
        self.conditional = np.concatenate([np.zeros((h, 1)), np.cumsum(cond, 1)], 1)
        self.conditional[:, -1] = 1.0
        marg = rows / rows.sum() if rows.sum() > 0 else np.full(h, 1.0 / h)
        self.marginal = np.concatenate([[0.0], np.cumsum(marg)])
        self.marginal[-1] = 1.0

    @classmethod
    def read(cls, path) -> EnvironmentMap:
        return cls(read_environment(path), source=str(path))

    @property
    def dark(self) -> bool:
        return not np.any(self.radiance > 0)

    def words(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        """(header words, body words) of the map laid out from word ``offset`` of the light data:
        the header (W, H, the radiance's offset, the marginal CDF's, the conditional CDFs'), the
        body the radiance (row-major rgb), the marginal CDF (H + 1) and the conditional CDFs
        (H rows of W + 1)."""
        h, w = self.radiance.shape[:2]
        body = [self.radiance.reshape(-1), self.marginal.astype(np.float32), self.conditional.astype(np.float32).reshape(-1)]
        offs = np.cumsum([offset] + [len(b) for b in body[:-1]])
        return np.array([w, h, *offs], np.float32), np.concatenate(body)

    def __repr__(self):
        return f"EnvironmentMap({self.source}, {self.radiance.shape[1]}x{self.radiance.shape[0]})"
