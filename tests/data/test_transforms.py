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
    with pytest.raises(ValueError, match="flip_prob"):
        ImageTransform(flip_prob=1.5)


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
