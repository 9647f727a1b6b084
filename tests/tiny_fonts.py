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
