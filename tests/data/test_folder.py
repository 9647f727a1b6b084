import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from shardfc.data import CorruptImageError, ImageFolderDataset, ListFileDataset, image_to_tensor


def _save(path: Path, value: int, size=(5, 4)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.full((size[0], size[1], 3), value, dtype=np.uint8)
    arr[0, 0] = (value + 1) % 256  # asymmetric, so flips would be visible
    Image.fromarray(arr).save(path)
    return path


def _expected(path, image_size=(5, 4)) -> torch.Tensor:
    return image_to_tensor(Image.open(path), image_size)


@pytest.fixture
def tree(tmp_path) -> Path:
    root = tmp_path / "faces"
    _save(root / "bob" / "b1.png", 10)
    (root / "bob" / "b2.jpg").write_bytes(b"garbage, not a jpeg")  # corrupt
    _save(root / "bob" / "b3.png", 30)
    _save(root / "alice" / "a1.png", 40)
    _save(root / "alice" / "a2.png", 50)
    _save(root / "carol" / "nested" / "c1.png", 60)
    (root / "carol" / "notes.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    _save(root / ".hidden" / "h.png", 70)
    return root


def test_image_folder_labels_and_samples(tree):
    ds = ImageFolderDataset(tree, image_size=(5, 4), train=False)
    assert ds.classes == ["alice", "bob", "carol"]
    assert ds.num_classes == 3
    names = [(Path(p).relative_to(tree).as_posix(), label) for p, label in ds.samples]
    assert names == [
        ("alice/a1.png", 0),
        ("alice/a2.png", 0),
        ("bob/b1.png", 1),
        ("bob/b2.jpg", 1),
        ("bob/b3.png", 1),
        ("carol/nested/c1.png", 2),
    ]
    x, y = ds[0]
    assert y == 0 and torch.equal(x, _expected(tree / "alice" / "a1.png"))
    assert ds.corrupt_count == 0


def test_corrupt_image_skipped_and_counted(tree, caplog):
    ds = ImageFolderDataset(tree, image_size=(5, 4), train=False)
    with caplog.at_level(logging.WARNING, logger="shardfc.data"):
        x, y = ds[3]  # bob/b2.jpg is corrupt -> next valid sample bob/b3.png
        assert y == 1 and torch.equal(x, _expected(tree / "bob" / "b3.png"))
        assert ds.corrupt_count == 1
        assert ds.corrupt_paths == {str(tree / "bob" / "b2.jpg")}
        x2, _ = ds[3]  # same substitute again, counted again, not warned again
        assert torch.equal(x2, x)
        assert ds.corrupt_count == 2
    warnings = [r for r in caplog.records if r.name == "shardfc.data"]
    assert len(warnings) == 1 and "b2.jpg" in warnings[0].getMessage()


def test_corrupt_last_sample_wraps_around(tmp_path):
    root = tmp_path / "r"
    _save(root / "a" / "1.png", 5)
    (root / "b").mkdir()
    (root / "b" / "2.png").write_bytes(b"bad")
    ds = ImageFolderDataset(root, image_size=(5, 4), train=False)
    x, y = ds[1]
    assert y == 0 and torch.equal(x, _expected(root / "a" / "1.png"))
    assert ds.corrupt_count == 1


def test_all_corrupt_raises(tmp_path):
    root = tmp_path / "r"
    (root / "a").mkdir(parents=True)
    (root / "a" / "1.png").write_bytes(b"bad")
    ds = ImageFolderDataset(root, train=False)
    with pytest.raises(RuntimeError, match="corrupt"):
        ds[0]


def test_training_flips_randomly(tree):
    ds = ImageFolderDataset(tree, image_size=(5, 4), train=True)
    base = _expected(tree / "alice" / "a1.png")
    outs = []
    for epoch in range(20):  # a function of (seed, epoch, index): the epoch changes the draw
        ds.set_epoch(epoch)
        outs.append(ds[0][0])
    flips = [torch.equal(o, base.flip(-1)) for o in outs]
    assert any(flips) and not all(flips)
    assert all(f or torch.equal(o, base) for o, f in zip(outs, flips))


def test_resizes_to_image_size(tree):
    ds = ImageFolderDataset(tree, image_size=[8, 6], train=False)
    assert ds[0][0].shape == (3, 8, 6) and ds.image_size == (8, 6)
    for bad in (8, (8,), (8, 0), (8.0, 6), None):  # 8 was "'int' object is not iterable"
        with pytest.raises(ValueError, match=re.escape(f"image_size must be a (height, width) pair of positive ints, "
                                                        f"got {bad!r}")):
            ImageFolderDataset(tree, image_size=bad)


def test_dataloader_batches(tree):
    ds = ImageFolderDataset(tree, image_size=(5, 4), train=False)
    x, y = next(iter(DataLoader(ds, batch_size=6)))
    assert x.shape == (6, 3, 5, 4)
    assert y.tolist() == [0, 0, 1, 1, 1, 2]  # the corrupt index returned bob/b3.png


def test_missing_and_empty_roots(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match="missing"):
        ImageFolderDataset(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty"):
        ImageFolderDataset(empty)
    (empty / "id0").mkdir()
    (empty / "id0" / "readme.txt").write_text("x")
    with pytest.raises(ValueError, match="no images"):
        ImageFolderDataset(empty)


# ----------------------------------------------------------------- list file
@pytest.fixture
def listed(tmp_path):
    imgs = tmp_path / "imgs"
    a = _save(imgs / "a.png", 1)
    b = _save(imgs / "sub dir" / "b.png", 2)
    c = _save(tmp_path / "elsewhere" / "c.png", 3)
    lst = tmp_path / "imgs" / "train.lst"
    lst.write_text(f"# comment\na.png 0\n\nsub dir/b.png 4\n{c} 2\n")
    return lst, [a, b, c]


def test_list_file_parsing(listed):
    lst, paths = listed
    ds = ListFileDataset(lst, image_size=(5, 4), train=False)
    assert [label for _, label in ds.samples] == [0, 4, 2]
    assert [Path(p) for p, _ in ds.samples] == paths
    assert ds.num_classes == 5
    for i, path in enumerate(paths):
        x, y = ds[i]
        assert torch.equal(x, _expected(path))


def test_list_file_root_argument(tmp_path, listed):
    lst, paths = listed
    other = tmp_path / "other.lst"
    other.write_text("a.png 0\n")
    ds = ListFileDataset(other, root=paths[0].parent, image_size=(5, 4), train=False)
    assert Path(ds.samples[0][0]) == paths[0]


def test_list_file_write_round_trip(tmp_path, listed):
    _, paths = listed
    lst = tmp_path / "written.lst"
    ListFileDataset.write(lst, [(p, i) for i, p in enumerate(paths)])
    ds = ListFileDataset(lst, train=False)
    assert [(Path(p), y) for p, y in ds.samples] == [(p, i) for i, p in enumerate(paths)]


def test_list_file_write_keeps_inner_spaces_and_refuses_what_would_not_read_back(tmp_path):
    lst = tmp_path / "written.lst"
    ListFileDataset.write(lst, [("a b/c d.png", 0), ("x#.png", 2)])
    assert lst.read_text(encoding="utf-8") == "a b/c d.png 0\nx#.png 2\n"
    read = ListFileDataset(lst, root="/r", train=False).samples
    assert read == [(os.path.join("/r", "a b/c d.png"), 0), (os.path.join("/r", "x#.png"), 2)]
    # each was written as a line that read back as another path, as a comment, or as two lines
    for path in ("#1.png", " lead.png", "trail.png ", "tab.png\t", "two\nlines.png", "\u2028sep.png", ""):
        with pytest.raises(ValueError, match=re.escape(f"ListFileDataset.write: path {path!r} would not read back "
                                                       "as itself (a line break in it, whitespace at either end, "
                                                       "or a leading '#')")):
            ListFileDataset.write(lst, [("ok.png", 1), (path, 0)])
    for label in (-1, 1.5, True, "3", None, np.float64(2.0), torch.tensor(2.0), torch.tensor(True),
                  torch.tensor([1, 2])):  # 1.5 was written as class 1
        with pytest.raises(ValueError, match=re.escape(f"ListFileDataset.write: label must be an int >= 0, got {label!r} "
                                                       "for 'n.png'")):
            ListFileDataset.write(lst, [("n.png", label)])
    assert lst.read_text(encoding="utf-8") == "a b/c d.png 0\nx#.png 2\n"  # a refused list leaves the file alone
    # numpy's integers and a dataset's targets iterated (0-d integer tensors) are class ids
    ListFileDataset.write(lst, [("np.png", np.int64(4)), *zip(["t.png", "u.png"], torch.tensor([5, 0]))])
    assert lst.read_text(encoding="utf-8") == "np.png 4\nt.png 5\nu.png 0\n"


def test_list_file_write_leaves_the_previous_list_whole_when_it_fails(tmp_path, monkeypatch):
    lst = tmp_path / "written.lst"
    ListFileDataset.write(lst, [("a.png", 0)])

    def full_disk(self, *args, **kwargs):
        Path.write_bytes(self, b"half a li")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match=f"cannot write {re.escape(str(lst))}: No space left on device"):
        ListFileDataset.write(lst, [("b.png", 1), ("c.png", 2)])
    monkeypatch.undo()
    assert lst.read_text(encoding="utf-8") == "a.png 0\n" and sorted(p.name for p in tmp_path.iterdir()) == ["written.lst"]

@pytest.mark.parametrize(
    "content, lineno, what",
    [
        ("a.png 0\nb.png\n", 2, "expected"),
        ("a.png 0\n\nb.png one\n", 3, "integer"),
        ("a.png -3\n", 1, ">= 0"),
    ],
)
def test_list_file_bad_lines(tmp_path, content, lineno, what):
    lst = tmp_path / "bad.lst"
    lst.write_text(content)
    with pytest.raises(ValueError, match=rf"bad\.lst:{lineno}: .*{what}"):
        ListFileDataset(lst)


def test_list_file_missing_or_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.lst"):
        ListFileDataset(tmp_path / "nope.lst")
    empty = tmp_path / "empty.lst"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no entries"):
        ListFileDataset(empty)


def test_list_file_missing_image_is_an_error(tmp_path):
    lst = tmp_path / "l.lst"
    lst.write_text("ghost.png 0\n")
    ds = ListFileDataset(lst)
    with pytest.raises(FileNotFoundError, match="ghost.png"):
        ds[0]


def test_list_file_corrupt_skipped(tmp_path):
    _save(tmp_path / "ok.png", 9)
    (tmp_path / "bad.png").write_bytes(b"xx")
    lst = tmp_path / "l.lst"
    lst.write_text("bad.png 0\nok.png 1\n")
    ds = ListFileDataset(lst, image_size=(5, 4), train=False)
    x, y = ds[0]
    assert y == 1 and ds.corrupt_count == 1


# ------------------------------------------------------------ what every file data set shares


def test_hidden_files_are_not_images(tmp_path):
    _save(tmp_path / "root" / "id" / "a.png", 1)
    _save(tmp_path / "root" / "id" / ".a.png", 2)
    _save(tmp_path / "root" / "id" / "b.PNG", 3)  # the extension in any case
    ds = ImageFolderDataset(tmp_path / "root")
    assert [Path(p).name for p, _ in ds.samples] == ["a.png", "b.PNG"]


@pytest.mark.parametrize("make", ["folder", "list"])
def test_settings_are_kept_and_defaults_are_a_training_set(tree, listed, make):
    def build(**kw):
        return ImageFolderDataset(tree, **kw) if make == "folder" else ListFileDataset(listed[0], **kw)

    ds = build()
    assert ds.train is True and ds.transform.random_flip and ds.seed == 0 and ds.epoch == 0
    assert ds.image_size == (112, 112) and ds.transform.flip_prob == 0.5
    ds = build(image_size=(5, 4), train=False, flip_prob=0.25, seed=9)
    assert ds.train is False and not ds.transform.random_flip and ds.seed == 9
    assert ds.image_size == (5, 4) and ds.transform.image_size == (5, 4) and ds.transform.flip_prob == 0.25
    assert ds.augmentation_generator(0, 0) is None  # nothing random to draw without training flips


def test_a_sample_s_generator_is_its_own_stream_of_the_seed(tree):
    from shardfc.data import folder
    from shardfc.seeding import mix_seed

    ds = ImageFolderDataset(tree, seed=5)
    gen = ds.augmentation_generator(3, 2)
    assert gen.initial_seed() == mix_seed(5, folder._STREAM_AUGMENT, 2, 3)  # flips stay those of earlier runs
    assert gen.initial_seed() != mix_seed(5, 2, 3)
    ds.set_epoch(2)
    assert ds.epoch == 2
    for seed in (-5, 2**64 + 5, 5.5):  # each the stream of seed 5's neighbours in 64-bit words, or truncated
        with pytest.raises(ValueError, match=re.escape(f"seed must be an int in [0, 2**63 - 1], got {seed!r}")):
            ImageFolderDataset(tree, seed=seed)


def test_the_bytes_and_label_of_a_sample_without_decoding(tree, tmp_path, special_file):
    ds = ImageFolderDataset(tree, image_size=(5, 4))
    path, label = ds.samples[1]
    assert ds.read_image_bytes(1) == Path(path).read_bytes() and ds.label_of(1) == label == 0
    assert [ds.label_of(i) for i in range(len(ds))] == [lab for _, lab in ds.samples]
    bob = Path(ds.samples[2][0])
    bob.unlink()
    with pytest.raises(FileNotFoundError) as info:
        ds.read_image_bytes(2)
    assert str(info.value) == f"image file not found: {str(bob)!r}"
    special_file(bob, "fifo")
    with pytest.raises(CorruptImageError) as info:
        ds.read_image_bytes(2)
    assert info.value.path == str(bob)
    assert info.value.reason == f"refusing to read image file {bob}: it is a FIFO, not a regular file"
    bob.unlink()
    os.symlink(tmp_path / "outside.png", bob)
    _save(tmp_path / "outside.png", 1)
    with pytest.raises(CorruptImageError) as info:  # inside the data set's folder only
        ds.read_image_bytes(2)
    assert "outside" in info.value.reason


def test_a_skip_says_which_image_and_why(tree, caplog):
    ds = ImageFolderDataset(tree, image_size=(5, 4), train=False)
    bad = str(tree / "bob" / "b2.jpg")
    index = [p for p, _ in ds.samples].index(bad)
    with caplog.at_level(logging.WARNING, logger="shardfc.data"):
        image, label, skipped = ds.load_sample(index, 0)
    [(name, reason)] = skipped
    assert name == bad and reason.startswith("UnidentifiedImageError: cannot identify image file")
    assert caplog.messages == [f"skipping corrupt image {bad} ({reason}); substituting the next valid sample"]
    assert ds._corrupt_reasons == {index: reason}
    assert ds.load_sample(index, 0)[2] == [(bad, reason)]  # known: skipped again without decoding
    assert len(caplog.messages) == 1


def test_an_index_from_minus_n_to_n_minus_1(tree):
    ds = ImageFolderDataset(tree, image_size=(5, 4), train=False)
    n = len(ds)
    assert torch.equal(ds[-n][0], ds[0][0]) and torch.equal(ds[n - 1][0], ds[-1][0])
    for index in (n, -n - 1):
        with pytest.raises(IndexError) as info:
            ds[index]
        assert str(info.value) == f"index {index} out of range for dataset of size {n}"
    assert repr(ds) == f"ImageFolderDataset(samples={n}, num_classes=3)"


def test_a_class_folder_linked_out_is_named(tmp_path):
    _save(tmp_path / "outside" / "a.png", 1)
    (tmp_path / "root").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "root" / "out")
    with pytest.raises(ValueError) as info:
        ImageFolderDataset(tmp_path / "root")
    assert str(info.value) == (f"refusing to read class folder {tmp_path / 'root' / 'out'}: it resolves to "
                               f"{tmp_path / 'outside'}, outside {tmp_path / 'root'}")


def test_a_list_file_is_named_by_the_gate(tmp_path, special_file):
    special_file(tmp_path / "train.lst", "fifo")
    with pytest.raises(ValueError) as info:
        ListFileDataset(tmp_path / "train.lst")
    assert str(info.value) == f"refusing to read list file {tmp_path / 'train.lst'}: it is a FIFO, not a regular file"
