"""Glyph identities: a face-recognition-shaped data set from the CJK fonts installed on the machine.

An identity is a character; its images are the character as different typefaces draw it —
designed by people, with real variation in stroke, weight and style — and thousands of characters
differ by one small component, as similar faces do. ``shardfc data glyphs OUT`` writes:

* ``train.rec`` / ``train.idx`` / ``property`` (insightface's RecordIO layout, so every loader and
  ``--loader dali`` read it) and ``classes.txt`` (the characters, so class-aware resumes work);
* three insightface verification ``.bin`` sets of 6,000 pairs in 10 folds, as LFW:
  ``glyphs_unseen.bin`` (characters never in training), ``glyphs_hard.bin`` (the same characters;
  each negative pair is one typeface drawing two characters that look most alike under it, by the
  pixel distance of their drawings) and ``glyphs_faces.bin`` (training characters drawn by
  typeface families held out of training, ``--holdout-faces``);
* ``glyphs.json``: what was built from what (faces, families, counts, options).

How (every step seeded, so a build on the same fonts is the same bytes):

1. **Faces** come from font files (``.ttf``, ``.otf``, ``.ttc``, ``.otc``; a collection counts
   each face) under the system's font folders or ``--fonts DIR…``; a file that cannot be read is
   skipped with a warning naming it. **Coverage** comes from each face's character map, never from
   the drawing (a face that lacks a character draws a box), restricted to the CJK Unified
   Ideographs U+4E00–U+9FFF.
2. **Drawings**: each (character, face) is drawn black on white at twice ``--image-size``, its ink
   cropped and centred at 84% of the side (the glyph's "alignment"), and reduced to the image size;
   a face whose drawing has no ink is not counted. Identical drawings of one character (a Mono or
   proportional variant, a region that shares the glyph) count once. Identities are characters with
   at least ``--min-faces`` distinct drawings.
3. **Families**: faces whose names differ only by region (SC, TC, JP, KR, HK, CN, TW), weight,
   Mono or a proportional ``P``, or that draw at least half their shared characters identically,
   are one family; ``--holdout-faces K`` keeps ``K`` families (drawn by the seed) out of training.
4. **Images**: each training drawing gives ``--copies`` images under the augmentations a face set
   has — small affine jitter (rotation, scale, shear, shift), stroke weight (thinner or bolder),
   blur and noise — seeded by (seed, character, face, copy). Verification images get one seeded
   augmentation each.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from shardfc import files

#: Where fonts live on Debian/Ubuntu (and the user's own folders).
SYSTEM_FONT_DIRS = ("/usr/share/fonts", "/usr/local/share/fonts", "~/.local/share/fonts", "~/.fonts")
FONT_SUFFIXES = (".ttf", ".otf", ".ttc", ".otc")
#: The CJK Unified Ideographs block: the characters identities are drawn from.
CJK_FIRST, CJK_LAST = 0x4E00, 0x9FFF
#: Debian/Ubuntu packages with CJK faces (``scripts/install_glyph_fonts.sh`` installs them).
FONT_PACKAGES = ("fonts-noto-cjk", "fonts-arphic-ukai", "fonts-arphic-uming", "fonts-wqy-zenhei", "fonts-wqy-microhei",
                 "fonts-ipafont-gothic", "fonts-ipafont-mincho", "fonts-droid-fallback", "fonts-vlgothic",
                 "fonts-takao-mincho")
#: LFW's shape: 10 folds of 300 positive and 300 negative pairs.
FOLDS, PAIRS_PER_FOLD = 10, 600
INK_SHARE = 0.84
_FAMILY_TOKENS = re.compile(
    r"\b(SC|TC|JP|KR|HK|CN|TW|MBE|Mono|Sharp|Thin|ExtraLight|Light|DemiLight|Regular|Normal|Medium|SemiBold|"
    r"DemiBold|Bold|ExtraBold|Black|Heavy)\b")
_PROPORTIONAL = re.compile(r"P(?=(Mincho|Gothic)\b)")


class GlyphError(Exception):
    """A glyph set cannot be built (no fonts, too few identities, bad options): one line for the CLI."""


@dataclass(frozen=True)
class Face:
    """One face of a font file: ``index`` in a collection, its family name and family key."""

    path: str
    index: int
    name: str
    family: str


@dataclass
class GlyphOptions:
    image_size: int = 32
    channels: int = 1
    min_faces: int = 8
    identities: int = 1000
    unseen_identities: int = 1000
    holdout_faces: int = 1
    copies: int = 2
    pairs: int = FOLDS * PAIRS_PER_FOLD
    seed: int = 0

    def check(self) -> None:
        for name in ("image_size", "min_faces", "identities", "unseen_identities", "copies", "pairs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GlyphError(f"{name} must be a positive integer, got {value!r}")
        if not 8 <= self.image_size <= 512:
            raise GlyphError(f"image_size must be in 8..512, got {self.image_size}")
        if self.channels not in (1, 3):
            raise GlyphError(f"channels must be 1 (grayscale) or 3, got {self.channels!r}")
        if self.min_faces < 2:
            raise GlyphError(f"min_faces must be at least 2 (a positive pair needs two drawings), got {self.min_faces}")
        if isinstance(self.holdout_faces, bool) or not isinstance(self.holdout_faces, int) or self.holdout_faces < 0:
            raise GlyphError(f"holdout_faces must be an integer >= 0, got {self.holdout_faces!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise GlyphError(f"seed must be an integer >= 0, got {self.seed!r}")  # numpy seeds only those
        if self.pairs % (2 * FOLDS):
            raise GlyphError(f"pairs must be a multiple of {2 * FOLDS} (10 folds of equal positives and negatives), "
                             f"got {self.pairs}")


# --------------------------------------------------------------------------- fonts
def font_files(dirs: Optional[Sequence[str]] = None, warn=None) -> List[str]:
    """Font files under ``dirs`` (default: :data:`SYSTEM_FONT_DIRS`), sorted, links to files kept once.

    Only regular files are kept (a FIFO or a device named like a font is never opened), and only
    those that resolve inside one of ``dirs``: a link out of the folders given is skipped with a
    warning naming it (``warn``, default :func:`warnings.warn`)."""
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=2))
    folders = [os.path.expanduser(d) for d in (dirs if dirs is not None else SYSTEM_FONT_DIRS)]
    roots = [os.path.realpath(d) for d in folders]
    found: Dict[str, str] = {}
    for d in folders:
        if dirs is not None and not os.path.isdir(d):
            raise GlyphError(f"--fonts {d!r} is not a folder")
        for root, subdirs, names in os.walk(d):
            subdirs.sort()
            for f in sorted(names):
                if f.lower().endswith(FONT_SUFFIXES):
                    path = os.path.join(root, f)
                    real = os.path.realpath(path)
                    if not os.path.isfile(real):
                        continue
                    if not any(real == r or os.path.commonpath([real, r]) == r for r in roots):
                        warn(f"shardfc data glyphs: skipped font file {path!r}: it resolves to {real}, outside "
                             f"{', '.join(folders)}")
                        continue
                    found.setdefault(real, path)
    return sorted(found.values())


#: The most faces read from one collection (``.ttc`` / ``.otc``): the largest CJK collections hold
#: a few dozen; a header claiming more is not read (each face costs a parse and a renderer).
MAX_FACES_PER_FILE = 256
#: The most faces read in all: the family merge compares faces pairwise, so its work grows with the
#: square of this. ``SHARDFC_MAX_FONT_FACES`` raises it.
MAX_FACES = 2048
#: The most tables one face's directory may list (real fonts have 10-30).
MAX_TABLES = 512
#: A font's tables are read as stored: a compressed (WOFF / WOFF2) file, whose tables would be
#: inflated, is not read; these are the signatures of the uncompressed sfnt formats.
SFNT_SIGNATURES = (b"\x00\x01\x00\x00", b"true", b"OTTO", b"ttcf")


def read_font(path: str) -> Tuple[bytes, int]:
    """``(bytes, face count)`` of font file ``path`` through the file gate (a regular file of at most
    256 MiB, ``SHARDFC_MAX_FONT_BYTES``), its structure checked before fontTools or FreeType sees
    it: an uncompressed sfnt (no table is ever inflated), at most :data:`MAX_FACES_PER_FILE` faces,
    each face's table directory and every table inside the file. Anything else is a ValueError (the
    caller skips the file, naming it)."""
    import struct

    data = files.read_bytes(path, "font", "font file")
    if data[:4] not in SFNT_SIGNATURES:
        raise ValueError(f"not an uncompressed TrueType / OpenType font (signature {data[:4]!r}; WOFF is not read)")
    if data[:4] == b"ttcf":
        if len(data) < 12:
            raise ValueError("a collection header cut short")
        (count,) = struct.unpack_from(">L", data, 8)
        if not 1 <= count <= MAX_FACES_PER_FILE or 12 + 4 * count > len(data):
            raise ValueError(f"its collection header claims {count} faces (at most {MAX_FACES_PER_FILE} are read, "
                             "each within the file)")
        starts = list(struct.unpack_from(f">{count}L", data, 12))
    else:
        count, starts = 1, [0]
    for start in starts:
        if start + 12 > len(data):
            raise ValueError(f"a face's table directory at {start} is past the end of the file")
        (tables,) = struct.unpack_from(">H", data, start + 4)
        if tables > MAX_TABLES or start + 12 + 16 * tables > len(data):
            raise ValueError(f"a face lists {tables} tables, more than the file or {MAX_TABLES} allow")
        for i in range(tables):
            tag, _, offset, length = struct.unpack_from(">4sLLL", data, start + 12 + 16 * i)
            if offset + length > len(data):
                raise ValueError(f"its {tag.decode('latin-1')!r} table ends at {offset + length}, past the end of "
                                 f"the file ({len(data)} bytes)")
    return data, count


def family_key(name: str) -> str:
    """The family a face's name belongs to: region, weight, Mono and proportional marks removed."""
    key = _PROPORTIONAL.sub("", _FAMILY_TOKENS.sub(" ", name))
    return " ".join(key.split()) or name


#: The Unicode subtables a character map is read from, best first (HarfBuzz's order, as fontTools'
#: ``getBestCmap`` has it).
CMAP_PREFERENCES = ((3, 10), (0, 6), (0, 4), (3, 1), (0, 3), (0, 2), (0, 1), (0, 0))


def cjk_coverage(cmap: bytes, first: int = CJK_FIRST, last: int = CJK_LAST) -> Set[int]:
    """The characters ``first..last`` that the best Unicode subtable of a raw ``cmap`` table maps to
    a glyph other than ``.notdef``.

    fontTools' decoding names every glyph of the font on the way (the ``post`` or CFF glyph order:
    two thirds of a glyph set's build went there); the ranges alone answer "covered or not". Only
    formats 4 and 12 are read (every CJK font here uses one of them), and only ranges as the formats
    require them (sorted, not overlapping), so the work is bounded by the block's size whatever a
    file claims. A short, damaged, out-of-format or other-format table raises (struct.error,
    ValueError): the caller skips the font, naming it."""
    import struct

    _, n = struct.unpack_from(">HH", cmap, 0)
    records = [struct.unpack_from(">HHL", cmap, 4 + 8 * i) for i in range(n)]
    offset = next((o for pref in CMAP_PREFERENCES for p, e, o in records if (p, e) == pref), None)
    if offset is None:
        return set()
    fmt = struct.unpack_from(">H", cmap, offset)[0]
    covered: Set[int] = set()
    if fmt == 12:
        (groups,) = struct.unpack_from(">L", cmap, offset + 12)
        table = np.frombuffer(cmap, ">u4", count=3 * groups, offset=offset + 16).reshape(-1, 3).astype(np.int64)
        table = table[(table[:, 1] >= first) & (table[:, 0] <= last)]
        _check_ordered(table[:, 0], table[:, 1], fmt)
        for start, end, glyph in table:
            lo, hi = max(int(start), first), min(int(end), last)
            covered.update(c for c in range(lo, hi + 1) if glyph + (c - start))  # .notdef at most at the start
        return covered
    if fmt == 4:
        (seg_x2,) = struct.unpack_from(">H", cmap, offset + 6)
        segs = seg_x2 // 2
        words = np.frombuffer(cmap, ">u2", count=4 * segs + 1, offset=offset + 14).astype(np.int64)
        end, start = words[:segs], words[segs + 1 : 2 * segs + 1]
        delta, range_at = words[2 * segs + 1 : 3 * segs + 1], offset + 16 + 6 * segs  # idRangeOffset[0]'s byte
        range_offset = words[3 * segs + 1 : 4 * segs + 1]
        inside = np.nonzero((end >= first) & (start <= last) & (start != 0xFFFF))[0]
        _check_ordered(start[inside], end[inside], fmt)
        for i in inside:
            for c in range(max(int(start[i]), first), min(int(end[i]), last) + 1):
                if range_offset[i] == 0:
                    glyph = (c + int(delta[i])) & 0xFFFF
                else:  # the glyph array entry idRangeOffset[i] bytes past idRangeOffset[i] itself
                    at = range_at + 2 * int(i) + int(range_offset[i]) + 2 * (c - int(start[i]))
                    (glyph,) = struct.unpack_from(">H", cmap, at)
                    glyph = (glyph + int(delta[i])) & 0xFFFF if glyph else 0
                if glyph:
                    covered.add(c)
        return covered
    raise ValueError(f"its Unicode character map is a format {fmt} subtable (only formats 4 and 12 are read)")


def _check_ordered(starts: np.ndarray, ends: np.ndarray, fmt: int) -> None:
    """Ranges as the format requires them — each non-empty and past the one before — or ValueError:
    reading them then costs at most one step a character of the block, whatever a (hostile) file
    claims (a million groups each claiming the whole block would not end)."""
    if not ((starts <= ends).all() and (starts[1:] > ends[:-1]).all()):
        raise ValueError(f"its format {fmt} character map has overlapping or unsorted ranges")


def read_faces(paths: Iterable[str], warn=None) -> List[Tuple[Face, Set[int]]]:
    """Each face of each file with the CJK characters its character map covers (faces covering
    none are left out); an unreadable file is skipped with a warning naming it."""
    import io

    from fontTools.ttLib import TTFont

    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=2))
    faces: List[Tuple[Face, Set[int]]] = []
    most = files.env_limit("SHARDFC_MAX_FONT_FACES", MAX_FACES)
    for path in paths:
        try:
            data, count = read_font(path)
            if len(faces) + count > most:
                warn(f"shardfc data glyphs: skipped font file {path!r} and the rest: more than {most} faces in all "
                     "(raise it with SHARDFC_MAX_FONT_FACES)")
                break
            for i in range(count):
                font = TTFont(io.BytesIO(data), fontNumber=i, lazy=True)
                covered = cjk_coverage(font.reader["cmap"]) if "cmap" in font.reader else set()
                name = font["name"].getDebugName(4) or font["name"].getDebugName(1) or f"{os.path.basename(path)}#{i}"
                family = font["name"].getDebugName(1) or name
                font.close()
                if covered:
                    faces.append((Face(path, i, name, family_key(family)), covered))
        except Exception as e:  # a damaged or unsupported file: skip it, say which
            warn(f"shardfc data glyphs: skipped font file {path!r}: {type(e).__name__}: {e}")
    return faces


def no_fonts_message(where: str) -> str:
    return (f"no CJK font found in {where}: install some, e.g. on Debian/Ubuntu `sudo apt-get install "
            f"{' '.join(FONT_PACKAGES)}` (scripts/install_glyph_fonts.sh), or pass --fonts DIR")


# --------------------------------------------------------------------------- drawing
class _Renderer:
    """Draws characters of one face: black on white, ink cropped and centred, at ``size``."""

    def __init__(self, face: Face, size: int):
        import io

        self.size = size
        self.canvas = 2 * size
        # From the bytes the gate read and checked (read_font), never by name: FreeType sees what was checked.
        data, _ = read_font(face.path)
        self.font = ImageFont.truetype(io.BytesIO(data), int(self.canvas * 0.8), index=face.index)

    def hires(self, ch: str) -> Optional[Image.Image]:
        """The ink of ``ch`` centred on a white ``2·size`` canvas (None: no ink, or a glyph whose box
        is larger than the canvas it is drawn on: its raster would be allocated whole first, and a
        hostile font's outline can claim any size)."""
        c = self.canvas
        left, top, right, bottom = self.font.getbbox(ch)
        if right - left > 2 * c or bottom - top > 2 * c:
            return None
        img = Image.new("L", (2 * c, 2 * c), 255)
        ImageDraw.Draw(img).text((c // 2, c // 2), ch, font=self.font, fill=0)
        ink = np.asarray(img) < 128
        if not ink.any():
            return None
        ys, xs = np.nonzero(ink)
        box = img.crop((int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1))
        w, h = box.size
        scale = INK_SHARE * c / max(w, h)
        box = box.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.LANCZOS)
        out = Image.new("L", (c, c), 255)
        out.paste(box, ((c - box.size[0]) // 2, (c - box.size[1]) // 2))
        return out

    def plain(self, hires: Image.Image) -> np.ndarray:
        return np.asarray(hires.resize((self.size, self.size), Image.LANCZOS))


def augment(hires: Image.Image, size: int, rng: np.random.Generator) -> Image.Image:
    """A face set's variation on one drawing: stroke weight, affine jitter, blur and noise."""
    c = hires.size[0]
    img = hires
    stroke = rng.integers(0, 3)  # 0: as drawn, 1: bolder (ink spreads), 2: thinner
    if stroke == 1:
        img = img.filter(ImageFilter.MinFilter(3))
    elif stroke == 2:
        thin = img.filter(ImageFilter.MaxFilter(3))
        # a hairline face would lose whole strokes: thin only what keeps most of its ink
        if (np.asarray(thin) < 128).sum() >= 0.6 * (np.asarray(img) < 128).sum():
            img = thin
    angle = np.deg2rad(rng.uniform(-6, 6))
    scale = rng.uniform(0.9, 1.1)
    shear = rng.uniform(-0.1, 0.1)
    tx, ty = rng.uniform(-0.06, 0.06, size=2) * c
    # the inverse map output -> input, about the centre, as Image.transform wants it
    a, b = np.cos(angle) / scale, np.sin(angle) / scale + shear
    d, e = -np.sin(angle) / scale, np.cos(angle) / scale
    cx = cy = c / 2
    coeffs = (a, b, cx - a * cx - b * cy - tx, d, e, cy - d * cx - e * cy - ty)
    img = img.transform((c, c), Image.AFFINE, coeffs, resample=Image.BILINEAR, fillcolor=255)
    img = img.resize((size, size), Image.LANCZOS)
    radius = rng.uniform(0.0, 0.7)
    if radius > 0.2:
        img = img.filter(ImageFilter.GaussianBlur(radius))
    sigma = rng.uniform(0.0, 8.0)
    arr = np.asarray(img, dtype=np.float32) + rng.normal(0.0, sigma, size=(size, size))
    return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L")


def encode_png(img: Image.Image, channels: int) -> bytes:
    import io

    if channels == 3:
        img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def _rng(seed: int, ch: str, face: int, copy: int, purpose: int = 0) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, ord(ch), face, copy, purpose]))


# --------------------------------------------------------------------------- the build
@dataclass
class _Drawings:
    """Per character, its distinct drawings: ``(face index, plain array)`` in face order; per face,
    how many characters it drew, and per pair of faces how many of the later one's drawings were
    identical to the earlier one's (and so dropped)."""

    by_char: Dict[str, List[Tuple[int, np.ndarray]]]
    drawn: Dict[int, int] = field(default_factory=dict)
    same: Dict[Tuple[int, int], int] = field(default_factory=dict)

    def add(self, other: "_Drawings", chars: Sequence[str]) -> None:
        for ch in chars:
            self.by_char[ch] = other.by_char[ch]
        for k, v in other.drawn.items():
            self.drawn[k] = self.drawn.get(k, 0) + v
        for k, v in other.same.items():
            self.same[k] = self.same.get(k, 0) + v


def _draw_all(faces: List[Face], chars: Sequence[str], covered: List[Set[int]], size: int,
              progress=None, warn=None, failed: Optional[Set[int]] = None) -> _Drawings:
    """Every character of ``chars`` drawn by every face covering it. A face FreeType cannot open or
    rasterise is skipped with a warning naming its file (``warn``) and added to ``failed``, which
    later calls skip without trying again; the drawings it made before failing are kept."""
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=2))
    failed = set() if failed is None else failed
    out = _Drawings({ch: [] for ch in chars})
    seen: Dict[str, Dict[bytes, int]] = {ch: {} for ch in chars}  # digest -> the face that drew it first
    for fi, face in enumerate(faces):
        if fi in failed:
            continue
        try:
            renderer = _Renderer(face, size)
        except Exception as e:  # FreeType's many failure types (OSError, ValueError, ...) all mean "skip it"
            warn(f"shardfc data glyphs: skipped font {face.path!r} face {face.index}: {type(e).__name__}: {e}")
            failed.add(fi)
            continue
        for ch in chars:
            if ord(ch) not in covered[fi]:
                continue
            try:
                hires = renderer.hires(ch)
            except Exception as e:
                warn(f"shardfc data glyphs: skipped font {face.path!r} face {face.index}: cannot draw {ch!r}: "
                     f"{type(e).__name__}: {e}")
                failed.add(fi)
                break
            if hires is None:  # no ink: the face maps the character to an empty glyph
                continue
            out.drawn[fi] = out.drawn.get(fi, 0) + 1
            plain = renderer.plain(hires)
            digest = hashlib.sha1(plain.tobytes()).digest()
            first = seen[ch].get(digest)
            if first is not None:
                out.same[(first, fi)] = out.same.get((first, fi), 0) + 1
                continue
            seen[ch][digest] = fi
            out.by_char[ch].append((fi, plain))
        if progress is not None:
            progress(fi + 1, len(faces))
    return out


def _families(faces: List[Face], drawings: _Drawings) -> List[int]:
    """Family id of each face: one per family name key (:func:`family_key`), merged with any face
    that draws at least half of its characters exactly as another does (a design under another
    name: Takao Mincho is IPA Mincho's)."""
    parent = list(range(len(faces)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    by_key: Dict[str, int] = {}
    for i, f in enumerate(faces):
        parent[find(i)] = find(by_key.setdefault(f.family, i))
    for (first, later), n in drawings.same.items():
        if n >= 0.5 * drawings.drawn.get(later, 0):
            parent[find(later)] = find(first)
    return [find(i) for i in range(len(faces))]


def build(out: str, options: GlyphOptions, font_dirs: Optional[Sequence[str]] = None, log=None,
          force: bool = False) -> dict:
    """Write the glyph set to ``out`` (see the module docstring); returns the summary written to
    ``glyphs.json``."""
    from shardfc.data.recordio_ops import check_outputs, staged_outputs, write_insightface

    options.check()
    log = log or sys.stderr
    font_paths = font_files(font_dirs, warn=lambda msg: print(f"warning: {msg}", file=log))
    where = ", ".join(font_dirs) if font_dirs is not None else "the system's font folders"
    if not font_paths:
        raise GlyphError(no_fonts_message(where))
    def warn(msg: str) -> None:
        print(f"warning: {msg}", file=log)

    read = read_faces(font_paths, warn=warn)
    if not read:
        raise GlyphError(no_fonts_message(where))
    faces = [f for f, _ in read]
    covered = [c for _, c in read]
    o = options
    rng = np.random.default_rng(o.seed)

    # candidates: covered by enough faces by their character maps; drawn, then kept with enough distinct drawings
    counts: Dict[int, int] = {}
    for c in covered:
        for code in c:
            counts[code] = counts.get(code, 0) + 1
    candidates = sorted(code for code, n in counts.items() if n >= o.min_faces)
    wanted = o.identities + o.unseen_identities
    if len(candidates) < wanted:
        raise GlyphError(f"{len(candidates)} characters are covered by at least {o.min_faces} faces "
                         f"({len(faces)} faces found), fewer than the {wanted} identities asked for "
                         f"(--identities {o.identities} + --unseen-identities {o.unseen_identities}); "
                         "install more fonts or lower them")
    order = rng.permutation(len(candidates))
    chars: List[str] = []
    drawings = _Drawings({})
    start = 0
    failed: Set[int] = set()  # faces FreeType could not draw: skipped from then on
    while len(chars) < wanted and start < len(order):
        batch = [chr(candidates[i]) for i in order[start:start + int(1.2 * (wanted - len(chars))) + 16]]
        start += len(batch)
        got = _draw_all(faces, batch, covered, o.image_size, warn=warn, failed=failed)
        kept = [ch for ch in batch if len(got.by_char[ch]) >= o.min_faces][:wanted - len(chars)]
        chars += kept
        drawings.add(got, kept)
    if len(chars) < wanted:
        raise GlyphError(f"only {len(chars)} characters have at least {o.min_faces} distinct drawings "
                         f"({wanted} asked for); lower --min-faces or the identity counts")
    train_chars, unseen_chars = sorted(chars[:o.identities]), sorted(chars[o.identities:])

    family = _families(faces, drawings)
    fam_ids = sorted(set(family))
    fam_order = [fam_ids[i] for i in rng.permutation(len(fam_ids))]
    if o.holdout_faces >= len(fam_ids):
        raise GlyphError(f"--holdout-faces {o.holdout_faces} leaves no typeface family for training "
                         f"({len(fam_ids)} families found)")
    held = set(fam_order[:o.holdout_faces])
    held_faces = {i for i, f in enumerate(family) if f in held}

    names = ["train.rec", "train.idx", "property", "classes.txt", "glyphs_unseen.bin", "glyphs_hard.bin",
             "glyphs_faces.bin", "glyphs.json"]
    os.makedirs(out, exist_ok=True)
    finals = [os.path.join(out, n) for n in names]
    check_outputs(finals, force)
    renderers: Dict[int, _Renderer] = {}

    def hires(ch: str, fi: int) -> Image.Image:
        if fi not in renderers:
            renderers[fi] = _Renderer(faces[fi], o.image_size)
        img = renderers[fi].hires(ch)
        assert img is not None
        return img

    def train_images() -> Iterator[Tuple[int, bytes, Tuple[int, int]]]:
        for label, ch in enumerate(train_chars):
            for fi, _ in drawings.by_char[ch]:
                if fi in held_faces:
                    continue
                h = hires(ch, fi)
                for copy in range(o.copies):
                    img = augment(h, o.image_size, _rng(o.seed, ch, fi, copy))
                    yield label, encode_png(img, o.channels), (o.image_size, o.image_size)

    def pair_image(ch: str, fi: int, k: int) -> bytes:
        return encode_png(augment(hires(ch, fi), o.image_size, _rng(o.seed, ch, fi, k, purpose=1)), o.channels)

    with staged_outputs(finals) as tmps:
        n_images, _, _ = write_insightface(tmps[0], tmps[1], tmps[2], train_images(), len(train_chars))
        with open(tmps[3], "w", encoding="utf-8") as f:
            f.writelines(ch + "\n" for ch in train_chars)
        seen_faces = {ch: [fi for fi, _ in drawings.by_char[ch] if fi not in held_faces] for ch in train_chars}
        sets = {
            "unseen": _pairs_unseen(unseen_chars, drawings, o, np.random.default_rng([o.seed, 1])),
            "hard": _pairs_hard(unseen_chars, drawings, o, np.random.default_rng([o.seed, 2])),
            "faces": _pairs_faces(train_chars, drawings, held_faces, seen_faces, o, np.random.default_rng([o.seed, 3])),
        }
        for (name, pairs), tmp in zip(sets.items(), tmps[4:7]):
            bins, issame = [], []
            for k, ((c1, f1), (c2, f2), same) in enumerate(pairs):
                bins += [pair_image(c1, f1, 2 * k), pair_image(c2, f2, 2 * k + 1)]
                issame.append(same)
            with open(tmp, "wb") as f:
                pickle.dump((bins, issame), f, protocol=4)
        summary = dict(
            identities=len(train_chars), unseen_identities=len(unseen_chars), images=n_images,
            unseen_characters="".join(unseen_chars),
            faces=[dict(asdict(f), family_id=family[i], held_out=i in held_faces) for i, f in enumerate(faces)],
            families=len(fam_ids), held_out_families=sorted({faces[i].family for i in held_faces}),
            pairs={k: len(v) for k, v in sets.items()}, options=asdict(o),
            drawings_per_identity=dict(zip(("min", "mean", "max"), _stats([len(seen_faces[c]) for c in train_chars]))),
        )
        with open(tmps[7], "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, ensure_ascii=False)
            f.write("\n")
    print(f"glyphs: {len(train_chars)} identities, {n_images} images at {o.image_size}x{o.image_size} from "
          f"{len(faces)} faces in {len(fam_ids)} families ({len(held_faces)} faces held out); "
          f"{len(unseen_chars)} unseen identities; 3 verification sets of {o.pairs} pairs -> {out}", file=log)
    return summary


def _stats(values: List[int]) -> Tuple[int, float, int]:
    return (min(values), round(float(np.mean(values)), 2), max(values)) if values else (0, 0.0, 0)


Pair = Tuple[Tuple[str, int], Tuple[str, int], bool]


def _fold_pairs(make_pos, make_neg, o: GlyphOptions) -> List[Pair]:
    """``o.pairs`` pairs in 10 folds, each fold its positives then its negatives (LFW's order)."""
    per = o.pairs // FOLDS // 2
    out: List[Pair] = []
    for _ in range(FOLDS):
        out += [make_pos() for _ in range(per)]
        out += [make_neg() for _ in range(per)]
    return out


def _two(rng, items):
    i, j = rng.choice(len(items), size=2, replace=False)
    return items[int(i)], items[int(j)]


def _pairs_unseen(chars, drawings: _Drawings, o, rng) -> List[Pair]:
    def pos():
        ch = chars[int(rng.integers(len(chars)))]
        (f1, _), (f2, _) = _two(rng, drawings.by_char[ch])
        return (ch, f1), (ch, f2), True

    def neg():
        c1, c2 = _two(rng, chars)
        f1 = drawings.by_char[c1][int(rng.integers(len(drawings.by_char[c1])))][0]
        f2 = drawings.by_char[c2][int(rng.integers(len(drawings.by_char[c2])))][0]
        return (c1, f1), (c2, f2), False

    return _fold_pairs(pos, neg, o)


def _pairs_hard(chars, drawings: _Drawings, o, rng) -> List[Pair]:
    """Negatives: one face drawing a character and the character most like it (smallest pixel
    distance between the two plain drawings) among the unseen characters that face draws."""
    by_face: Dict[int, Tuple[List[str], np.ndarray]] = {}
    for ch in chars:
        for fi, arr in drawings.by_char[ch]:
            by_face.setdefault(fi, ([], []))
            by_face[fi][0].append(ch)
            by_face[fi][1].append(arr.astype(np.float32).ravel())
    faces = sorted(fi for fi, (cs, _) in by_face.items() if len(cs) >= 2)
    mats = {fi: (by_face[fi][0], np.stack(by_face[fi][1])) for fi in faces}

    def neg():
        fi = faces[int(rng.integers(len(faces)))]
        cs, m = mats[fi]
        i = int(rng.integers(len(cs)))
        d = ((m - m[i]) ** 2).sum(axis=1)
        d[i] = np.inf
        d[[k for k, c in enumerate(cs) if c == cs[i]]] = np.inf
        j = int(np.argmin(d))
        return (cs[i], fi), (cs[j], fi), False

    positives = _pairs_unseen(chars, drawings, o, rng)
    pos_iter = iter([p for p in positives if p[2]])
    return _fold_pairs(lambda: next(pos_iter), neg, o)


def _pairs_faces(chars, drawings: _Drawings, held: Set[int], seen_faces, o, rng) -> List[Pair]:
    """Training characters, each pair with a drawing by a held-out face family: positives with the
    same character by a training face; negatives another character by any face."""
    with_held = [ch for ch in chars if any(fi in held for fi, _ in drawings.by_char[ch]) and seen_faces[ch]]
    if not held or not with_held:
        return []

    def held_face(ch):
        options = [fi for fi, _ in drawings.by_char[ch] if fi in held]
        return options[int(rng.integers(len(options)))]

    def pos():
        ch = with_held[int(rng.integers(len(with_held)))]
        return (ch, held_face(ch)), (ch, seen_faces[ch][int(rng.integers(len(seen_faces[ch])))]), True

    def neg():
        c1, c2 = _two(rng, with_held)
        return (c1, held_face(c1)), (c2, drawings.by_char[c2][int(rng.integers(len(drawings.by_char[c2])))][0]), False

    return _fold_pairs(pos, neg, o)


__all__ = ["FONT_PACKAGES", "Face", "GlyphError", "GlyphOptions", "augment", "build", "family_key", "font_files", "read_font",
           "read_faces"]
