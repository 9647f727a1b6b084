import io

import numpy as np
import pytest
import torch
from PIL import Image

from shardfc.data import CorruptImageError, ImageTransform, decode_image, image_to_tensor, normalize, pil_to_tensor


def _png_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def rgb() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(6, 4, 3), dtype=np.uint8)


def test_decode_path_bytes_and_numpy_agree(tmp_path, rgb):
    data = _png_bytes(rgb)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    for source in (path, str(path), data, bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8)):
        img = decode_image(source)
        assert img.mode == "RGB" and img.size == (4, 6)
        np.testing.assert_array_equal(np.asarray(img), rgb)


def test_decode_converts_gray_and_rgba_to_rgb():
    gray = np.full((3, 3), 7, dtype=np.uint8)
    assert np.asarray(decode_image(_png_bytes(gray))).shape == (3, 3, 3)
    rgba = np.zeros((3, 3, 4), dtype=np.uint8)
    assert decode_image(_png_bytes(rgba)).mode == "RGB"


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_a_16_bit_gray_image_is_scaled_to_8_bits_not_clipped(fmt):
    wide = np.array([[0, 257, 32768, 60000, 65535]], dtype=np.uint16)
    buf = io.BytesIO()
    Image.fromarray(wide).save(buf, format=fmt)
    img = decode_image(buf.getvalue())
    assert Image.open(io.BytesIO(buf.getvalue())).mode.startswith("I;16")  # what the file holds
    # Pillow's own conversion clipped: 32768, 60000 and 65535 all became 255
    assert np.asarray(img)[0, :, 0].tolist() == [0, 1, 128, 233, 255] and img.mode == "RGB"
    assert image_to_tensor(Image.fromarray(wide), normalized=False)[0, 0].tolist() == [0, 1, 128, 233, 255]


@pytest.mark.parametrize("mode, kind, value", [("F", "floats", 0.5), ("I", "integers", 70000)])
def test_32_bit_pixels_are_refused_naming_the_image_not_guessed(mode, kind, value):
    buf = io.BytesIO()
    Image.new(mode, (3, 2), value).save(buf, format="TIFF")
    message = (f"its pixels are 32-bit {kind} (mode {mode!r}), whose range does not say which value is black or "
               "white: save it with 8 or 16 bits a channel")
    with pytest.raises(CorruptImageError) as err:  # (0.5 as F became black, silently)
        decode_image(buf.getvalue(), name="faces/a.tif")
    assert (err.value.path, err.value.reason) == ("faces/a.tif", message)
    with pytest.raises(CorruptImageError) as err:
        image_to_tensor(Image.new(mode, (3, 2), value))
    assert (err.value.path, err.value.reason) == ("<image>", message)


def test_corrupt_input_raises_named_error(tmp_path, rgb):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"definitely not an image")
    with pytest.raises(CorruptImageError, match="broken.jpg") as info:
        decode_image(bad)
    assert isinstance(info.value, ValueError)
    assert info.value.path == str(bad)

    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(_png_bytes(rgb)[:40])
    with pytest.raises(CorruptImageError, match="truncated.png"):
        decode_image(truncated)

    with pytest.raises(CorruptImageError, match=r"lfw\.bin\[3\]"):
        decode_image(b"\x00\x01", name="lfw.bin[3]")


def test_missing_file_is_not_corrupt(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.png"):
        decode_image(tmp_path / "nope.png")


def test_normalise_range():
    x = torch.tensor([0, 255, 51], dtype=torch.uint8)
    torch.testing.assert_close(normalize(x), torch.tensor([-1.0, 1.0, -0.6]))


def test_image_to_tensor_values_and_layout(rgb):
    img = Image.fromarray(rgb)
    x = image_to_tensor(img)
    assert x.shape == (3, 6, 4) and x.dtype == torch.float32
    expected = (torch.from_numpy(rgb).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    torch.testing.assert_close(x, expected)
    assert torch.equal(pil_to_tensor(img), torch.from_numpy(rgb).permute(2, 0, 1))
    # Same size: no resampling, values untouched.
    torch.testing.assert_close(image_to_tensor(img, (6, 4)), expected)
    torch.testing.assert_close(image_to_tensor(img, flip=True), expected.flip(-1))


def test_resize_uses_height_width_order(rgb):
    x = image_to_tensor(Image.fromarray(rgb), image_size=(10, 7))
    assert x.shape == (3, 10, 7)
    assert x.min() >= -1 and x.max() <= 1


@pytest.mark.parametrize("bad", [(0, 4), (4,), "112", (4.0, 4)])
def test_bad_image_size(bad, rgb):
    with pytest.raises(ValueError, match="image_size"):
        image_to_tensor(Image.fromarray(rgb), image_size=bad)


def test_transform_random_flip_with_generator(rgb):
    img = Image.fromarray(rgb)
    base = image_to_tensor(img)
    t = ImageTransform(image_size=None, random_flip=True)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    seq1 = [t(img, generator=g1) for _ in range(16)]
    seq2 = [t(img, generator=g2) for _ in range(16)]
    assert all(torch.equal(a, b) for a, b in zip(seq1, seq2))
    flipped = [torch.equal(x, base.flip(-1)) for x in seq1]
    assert any(flipped) and not all(flipped)
    assert all(torch.equal(x, base) or f for x, f in zip(seq1, flipped))

    assert torch.equal(ImageTransform(None, random_flip=True, flip_prob=1.0)(img), base.flip(-1))
    assert torch.equal(ImageTransform(None, random_flip=True, flip_prob=0.0)(img), base)
    assert torch.equal(ImageTransform(None, random_flip=False)(img), base)
    with pytest.raises(ValueError, match=r"^flip_prob must be in \[0, 1\], got 1.5$"):
        ImageTransform(flip_prob=1.5)
    for bad in (True, "0.5", float("nan")):  # True was a probability of 1; "0.5" a TypeError naming nothing
        with pytest.raises(ValueError, match=f"^flip_prob must be a finite number, got {bad!r}$"):
            ImageTransform(flip_prob=bad)
    assert ImageTransform(flip_prob=1).flip_prob == 1.0 and type(ImageTransform(flip_prob=0).flip_prob) is float


def _erased_boxes(before, after):
    """Per image, the bounding box (top, bottom, left, right) of changed pixels, or None."""
    boxes = []
    for b, a in zip(before, after):
        changed = (b != a).any(0)
        if not changed.any():
            boxes.append(None)
            continue
        rows, cols = changed.any(1).nonzero().flatten(), changed.any(0).nonzero().flatten()
        boxes.append((int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1))
    return boxes


def test_random_erasing_is_one_seeded_rectangle_of_bounded_area():
    from shardfc.data.transforms import random_erase_

    images = torch.rand(64, 3, 32, 16) + 0.5  # never 0, so every erased pixel shows
    a = random_erase_(images.clone(), 1.0, torch.Generator().manual_seed(3))
    b = random_erase_(images.clone(), 1.0, torch.Generator().manual_seed(3))
    c = random_erase_(images.clone(), 1.0, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    boxes = _erased_boxes(images, a)
    assert sum(box is not None for box in boxes) >= 60  # a rectangle that never fits is rare
    for img, box in zip(a, boxes):
        if box is None:
            continue
        top, bottom, left, right = box
        assert (img[:, top:bottom, left:right] == 0).all()  # a filled rectangle, all channels
        frac = (bottom - top) * (right - left) / (32 * 16)
        assert 0.01 <= frac <= 0.45, frac  # area (0.02, 0.4) of the image, up to rounding
        assert (bottom - top) < 32 and (right - left) < 16


def test_random_erasing_probability():
    from shardfc.data.transforms import random_erase_

    images = torch.rand(400, 3, 16, 8) + 0.5
    untouched = random_erase_(images.clone(), 0.0, torch.Generator().manual_seed(0))
    assert torch.equal(untouched, images)
    half = random_erase_(images.clone(), 0.5, torch.Generator().manual_seed(0))
    erased = sum(box is not None for box in _erased_boxes(images, half))
    assert 150 <= erased <= 230, erased  # ~200 of 400, minus the few rectangles that never fit
    with pytest.raises(ValueError, match="prob must be in"):
        random_erase_(images, 1.5, torch.Generator())


# ------------------------------------------------------------ the edges, exactly


def test_an_encoded_array_may_be_bytes_of_any_numpy_kind_but_not_numbers(rgb):
    data = _png_bytes(rgb)
    expected = np.asarray(decode_image(data))
    assert np.array_equal(np.asarray(decode_image(np.frombuffer(data, np.uint8))), expected)
    assert np.array_equal(np.asarray(decode_image(np.array(data))), expected)  # dtype S
    assert np.array_equal(np.asarray(decode_image(np.frombuffer(data, f"V{len(data)}"))), expected)  # dtype V
    with pytest.raises(TypeError) as info:
        decode_image(np.zeros(4, np.int32))
    assert str(info.value) == "encoded image array must have dtype uint8, got int32"


def test_a_corrupt_image_is_named_as_asked(tmp_path, special_file):
    for source, name, said in ((b"junk", None, "<bytes>"), (b"junk", "lfw.bin[3]", "lfw.bin[3]")):
        with pytest.raises(CorruptImageError) as info:
            decode_image(source, name)
        assert info.value.path == said and info.value.reason == "UnidentifiedImageError: cannot identify image file"
        assert str(info.value) == f"cannot decode image {said!r}: {info.value.reason}"
    path = tmp_path / "x.png"
    special_file(path, "fifo")
    for name, said in ((None, str(path)), ("face 7", "face 7")):
        with pytest.raises(CorruptImageError) as info:
            decode_image(path, name)
        assert info.value.path == said and info.value.reason == f"refusing to read image file {path}: it is a FIFO, not a regular file"


def test_an_image_of_exactly_the_pixel_cap_is_decoded_and_one_more_refused(monkeypatch):
    monkeypatch.setenv("SHARDFC_MAX_IMAGE_PIXELS", "12")
    assert decode_image(_png_bytes(np.zeros((4, 3, 3), np.uint8))).size == (3, 4)
    with pytest.raises(CorruptImageError) as info:
        decode_image(_png_bytes(np.zeros((13, 1, 3), np.uint8)))
    assert info.value.reason == ("it declares 1x13 = 13 pixels, more than the 12 allowed "
                                 "(raise it with SHARDFC_MAX_IMAGE_PIXELS)")


def test_pixels_are_rgb_uint8_and_normalised_to_float32():
    gray = Image.fromarray(np.arange(6, dtype=np.uint8).reshape(2, 3))
    x = pil_to_tensor(gray)
    assert x.dtype == torch.uint8 and x.shape == (3, 2, 3) and torch.equal(x[0], x[2])
    assert normalize(torch.tensor([0.0, 255.0], dtype=torch.float64)).dtype == torch.float32
    assert image_to_tensor(gray, (1, 1)).shape == (3, 1, 1)  # the smallest size


def test_a_resize_is_bilinear_and_of_the_image_in_rgb(rgb):
    img = Image.fromarray(rgb)
    expected = np.asarray(img.resize((3, 5), Image.BILINEAR), dtype=np.float32)
    got = image_to_tensor(img, (5, 3), normalized=False).permute(1, 2, 0).numpy()
    assert np.array_equal(got, expected)
    palette = img.convert("P")  # Pillow resizes a palette image by its nearest pixel: convert first
    expected = np.asarray(palette.convert("RGB").resize((3, 5), Image.BILINEAR), dtype=np.float32)
    assert np.array_equal(image_to_tensor(palette, (5, 3), normalized=False).permute(1, 2, 0).numpy(), expected)
    wide = np.zeros((4, 4), np.uint16)
    wide[:, 2:] = 65535  # a 16-bit image: scaled to 8 bits when made RGB, before the resize blends it
    got = image_to_tensor(Image.fromarray(wide), (2, 3), normalized=False)[0]
    assert got.tolist() == [[0, 128, 255]] * 2


def test_a_transform_does_not_flip_unless_asked_and_keeps_its_output_kind(rgb):
    img = Image.fromarray(rgb)
    gen = torch.Generator().manual_seed(0)
    assert all(not ImageTransform(None).draw_flip(gen) for _ in range(20))
    raw = ImageTransform((6, 4), normalized=False)(img)
    assert raw.dtype == torch.uint8 and torch.equal(normalize(raw), ImageTransform((6, 4))(img))
    assert repr(ImageTransform((6, 4), random_flip=True, flip_prob=0.25, normalized=False)) == (
        "ImageTransform(image_size=(6, 4), random_flip=True, flip_prob=0.25, normalized=False)")


def _boxes_of(images, prob, seed, **kw):
    from shardfc.data.transforms import random_erase_

    before = images.clone()
    return _erased_boxes(before, random_erase_(images, prob, torch.Generator().manual_seed(seed), **kw))


def test_random_erasing_places_its_rectangle_anywhere_it_fits():
    boxes = _boxes_of(torch.ones(600, 1, 8, 6), 1.0, 0, area=(0.25, 0.25), aspect=(4 / 3, 4 / 3))
    assert all((b - t, r - l) == (4, 3) for t, b, l, r in boxes)  # sqrt(12 * 4/3) x sqrt(12 / (4/3))
    assert {t for t, _, _, _ in boxes} == set(range(5)) and {l for _, _, l, _ in boxes} == set(range(4))


def test_random_erasing_spans_its_area_and_aspect_ranges():
    boxes = [b for b in _boxes_of(torch.ones(800, 1, 100, 100), 1.0, 1, area=(0.05, 0.2), aspect=(0.5, 2.0))
             if b is not None]
    areas = [(b - t) * (r - l) / 1e4 for t, b, l, r in boxes]
    ratios = [(b - t) / (r - l) for t, b, l, r in boxes]
    assert 0.045 < min(areas) < 0.06 and 0.18 < max(areas) < 0.21
    assert 0.45 < min(ratios) < 0.6 and 1.7 < max(ratios) < 2.2


def test_random_erasing_one_pixel_is_a_rectangle_and_the_whole_height_is_not():
    boxes = _boxes_of(torch.ones(20, 1, 8, 8), 1.0, 2, area=(1 / 64, 1 / 64), aspect=(1.0, 1.0))
    assert all(b is not None and (b[1] - b[0], b[3] - b[2]) == (1, 1) for b in boxes)
    assert _boxes_of(torch.ones(20, 1, 8, 32), 1.0, 2, area=(0.25, 0.25), aspect=(1.0, 1.0)) == [None] * 20  # 8 x 8
    assert _boxes_of(torch.ones(20, 1, 32, 8), 1.0, 2, area=(0.25, 0.25), aspect=(1.0, 1.0)) == [None] * 20


def test_random_erasing_draws_again_a_rectangle_that_rounds_to_nothing():
    boxes = _boxes_of(torch.ones(400, 1, 16, 16), 1.0, 3, area=(0.0001, 0.02))
    assert sum(b is not None for b in boxes) >= 390


def test_random_erasing_draws_only_from_its_generator_ten_times_at_most():
    from shardfc.data.transforms import random_erase_

    images = torch.ones(1, 1, 8, 32)  # a rectangle of 8 x 8 never fits: every try is drawn
    gen, replay = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    random_erase_(images, 1.0, gen, area=(0.25, 0.25), aspect=(1.0, 1.0))
    torch.rand((), generator=replay)
    for _ in range(10):
        torch.rand(4, generator=replay, dtype=torch.float64)
    assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=replay))
    outs = []
    for seed in range(8):
        torch.manual_seed(seed)  # the global generator must not matter
        outs.append(random_erase_(torch.ones(16, 1, 8, 8), 0.5, torch.Generator().manual_seed(5)))
    assert all(torch.equal(o, outs[0]) for o in outs)
    with pytest.raises(ValueError) as info:
        random_erase_(torch.ones(3, 8, 8), 0.5, gen)
    assert str(info.value) == "images must be [N, C, H, W], got shape (3, 8, 8)"
