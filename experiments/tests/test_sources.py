"""The packaged real-data sources of the offline worlds (installed by experiments/scripts/install_world_data.sh)."""

import numpy as np
import pytest

from featcal_experiments.worlds import sources


@pytest.mark.parametrize(
    "load, classes",
    [
        (lambda: sources.fashion_mnist(16, 6, 3, seed=0), 10),
        (lambda: sources.mnist_5k(16, 6, 3, seed=0), 10),
        (lambda: sources.optical_digits(16, 6, 3, seed=0), 10),
        (lambda: sources.textile(16, 6, 3, seed=0), 3),
        (lambda: sources.clipart(["animals", "food", "transportation"], 16, 6, 3, seed=0), 3),
    ],
)
def test_sources_are_class_balanced_disjoint_and_seeded(load, classes):
    task = load()
    assert len(task.classnames) == classes
    assert task.counts() == {"train": [6] * classes, "test": [3] * classes}
    assert task.train_images.shape[1:] == (16, 16, 3) and task.train_images.dtype == np.uint8
    train = {x.tobytes() for x in task.train_images}
    assert not any(x.tobytes() in train for x in task.test_images), "an image is in both splits"
    again = load()
    assert np.array_equal(task.train_images, again.train_images)
    assert np.array_equal(task.test_labels, again.test_labels)


def test_glyph_tasks_split_train_and_test_by_font():
    task = sources.glyphs("greek", sources.GREEK_CAPITALS, sources.GREEK_NAMES, 16, renders_per_font=1, seed=0)
    counts = task.counts()
    assert len(set(counts["train"])) == 1 and len(set(counts["test"])) == 1  # every font draws every letter
    assert counts["test"][0] >= 1 and counts["train"][0] >= 3 * counts["test"][0] // 2
    assert "held out for test" in task.source


def test_symbol_fonts_are_rejected_for_letters():
    from PIL import ImageFont

    fonts = sources.installed_fonts()
    kept = set(sources.usable_fonts(sources.LATIN_CAPITALS, fonts))
    families = {ImageFont.truetype(str(p), 12).getname()[0] for p in fonts if p not in kept}
    assert "D050000L" in families  # URW's dingbats map A-Z to symbols
    assert len(kept) >= 20


def test_oversized_pngs_are_skipped_without_decoding(tmp_path, monkeypatch):
    from PIL import Image

    path = tmp_path / "big.png"
    Image.new("RGB", (300, 300), (10, 20, 30)).save(path)
    monkeypatch.setattr(sources, "MAX_DECODE_PIXELS", 300 * 300 - 1)
    assert sources._load_bounded(path, 8) is None
    monkeypatch.setattr(sources, "MAX_DECODE_PIXELS", 300 * 300)
    assert sources._load_bounded(path, 8).shape == (8, 8, 3)


def test_headers_pil_refuses_as_bombs_are_skipped(tmp_path, monkeypatch):
    # openclipart-png holds a ~620-megapixel PNG, beyond twice PIL's limit: PIL raises on open.
    from PIL import Image

    path = tmp_path / "bomb.png"
    Image.new("RGB", (300, 300)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300 * 300 // 2 - 1)
    assert sources._load_bounded(path, 8) is None
