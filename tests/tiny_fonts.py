"""Small TrueType fonts built by fontTools (one glyph; rectangles per character) for the tests of the glyph set's font reader
(``tests/data/test_glyphs.py``) and of the hostile fonts it refuses (``tests/checkpoint/test_hostile_files.py``)."""

from __future__ import annotations

from typing import Optional


def one_glyph_font(family: str, units_per_em: int = 1000, extent: int = 900):
    """A ``FontBuilder`` whose one glyph, a bar ``extent`` units wide, is mapped from U+4E00 (一), its
    family ``family``; the caller changes what it tests (the name or character map tables) and saves."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    fb = FontBuilder(units_per_em, isTTF=True)
    fb.setupGlyphOrder([".notdef", "yi"])
    fb.setupCharacterMap({0x4E00: "yi"})
    pen = TTGlyphPen(None)
    pen.moveTo((100, 400)), pen.lineTo((extent, 400)), pen.lineTo((extent, 500)), pen.lineTo((100, 500)), pen.closePath()
    fb.setupGlyf({".notdef": TTGlyphPen(None).glyph(), "yi": pen.glyph()})
    fb.setupHorizontalMetrics({".notdef": (500, 0), "yi": (1000, 100)})
    fb.setupHorizontalHeader(ascent=880, descent=-120)
    fb.setupNameTable({"familyName": family, "styleName": "Regular"})
    fb.setupOS2()
    fb.setupPost()
    return fb


def rect_font(path, family: str, shapes: dict, units_per_em: int = 1000, ascent: int = 880,
              descent: int = -120, os2: Optional[dict] = None) -> str:
    """A TrueType font named ``family`` whose glyph for each character of ``shapes`` ``{char: [(x0, y0,
    x1, y1), ...]}`` is those rectangles of ink (none: an empty glyph), every advance one em; ``os2``:
    fields of its OS/2 table."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    fb = FontBuilder(units_per_em, isTTF=True)
    names = [f"g{ord(ch):x}" for ch in shapes]
    fb.setupGlyphOrder([".notdef"] + names)
    fb.setupCharacterMap({ord(ch): name for ch, name in zip(shapes, names)})
    drawn = {".notdef": TTGlyphPen(None).glyph()}
    for name, rects in zip(names, shapes.values()):
        pen = TTGlyphPen(None)
        for x0, y0, x1, y1 in rects:
            pen.moveTo((x0, y0)), pen.lineTo((x1, y0)), pen.lineTo((x1, y1)), pen.lineTo((x0, y1)), pen.closePath()
        drawn[name] = pen.glyph()
    fb.setupGlyf(drawn)
    fb.setupHorizontalMetrics({name: (units_per_em, 0) for name in drawn})
    fb.setupHorizontalHeader(ascent=ascent, descent=descent)
    fb.setupNameTable({"familyName": family, "styleName": "Regular"})
    fb.setupOS2(**(os2 or {}))
    fb.setupPost()
    fb.save(str(path))
    return str(path)


def bar_font(path, family: str, glyphs: dict) -> str:
    """A TrueType font named ``family`` whose glyph for each character of ``glyphs`` ``{char: (x, h)}``
    is a bar along the bottom and a 200-unit-wide block at ``x`` units, ``h`` units tall: drawings
    that differ by a block's place (one character from another) or height (one face from another).
    A ``(x, h)`` of None maps the character to an empty glyph."""
    return rect_font(path, family, {ch: [] if shape is None else [(100, 0, 900, 150), (shape[0], 250, shape[0] + 200, 250 + shape[1])]
                                    for ch, shape in glyphs.items()})
