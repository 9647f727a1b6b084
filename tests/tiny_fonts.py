"""A TrueType font of one glyph, built by fontTools, for the tests of the glyph set's font reader
(``tests/data/test_glyphs.py``) and of the hostile fonts it refuses (``tests/checkpoint/test_hostile_files.py``)."""

from __future__ import annotations


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


def bar_font(path, family: str, glyphs: dict) -> str:
    """A TrueType font named ``family`` whose glyph for each character of ``glyphs`` ``{char: (x, h)}``
    is a bar along the bottom and a 200-unit-wide block at ``x`` units, ``h`` units tall: drawings
    that differ by a block's place (one character from another) or height (one face from another).
    A ``(x, h)`` of None maps the character to an empty glyph."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    fb = FontBuilder(1000, isTTF=True)
    names = [f"g{ord(ch):x}" for ch in glyphs]
    fb.setupGlyphOrder([".notdef"] + names)
    fb.setupCharacterMap({ord(ch): name for ch, name in zip(glyphs, names)})
    drawn = {".notdef": TTGlyphPen(None).glyph()}
    for name, shape in zip(names, glyphs.values()):
        pen = TTGlyphPen(None)
        if shape is not None:
            x, h = shape
            for x0, y0, x1, y1 in ((100, 0, 900, 150), (x, 250, x + 200, 250 + h)):
                pen.moveTo((x0, y0)), pen.lineTo((x1, y0)), pen.lineTo((x1, y1)), pen.lineTo((x0, y1)), pen.closePath()
        drawn[name] = pen.glyph()
    fb.setupGlyf(drawn)
    fb.setupHorizontalMetrics({name: (1000, 0) for name in drawn})
    fb.setupHorizontalHeader(ascent=880, descent=-120)
    fb.setupNameTable({"familyName": family, "styleName": "Regular"})
    fb.setupOS2()
    fb.setupPost()
    fb.save(str(path))
    return str(path)
