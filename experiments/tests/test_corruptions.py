"""ImageNet-C corruptions used for corrupted-calibration runs."""

import numpy as np
import pytest
from PIL import Image

from featcal_experiments.corruptions import (
    CorruptedImageDataset,
    corrupt,
    fog,
    gaussian_noise,
    motion_blur,
    plasma_fractal,
)


def rng(seed=0):
    return np.random.default_rng(seed)


def test_gaussian_noise_has_imagenet_c_scale_at_severity_3():
    x = np.full((224, 224, 3), 0.5)
    y = gaussian_noise(x, 3, rng())
    assert abs(float((y - x).std()) - 0.18) < 0.005  # clipping at 0.5 +- 0.18 is rare


def test_motion_blur_keeps_flat_images_and_spreads_a_point_along_one_line():
    flat = np.full((64, 64, 3), 0.3)
    np.testing.assert_allclose(motion_blur(flat, 3, rng()), flat)
    point = np.zeros((64, 64, 3))
    point[32, 32] = 1.0
    blurred = motion_blur(point, 3, rng(1))
    assert blurred.max() < 0.2 and abs(blurred.sum() - 3.0) < 1e-6  # spread, mass kept (inside the image)
    lit = np.argwhere(blurred[..., 0] > 0)
    centred = lit - lit.mean(0)
    singular = np.linalg.svd(centred, compute_uv=False)
    assert singular[1] < 0.2 * singular[0], "the blur follows one direction"


def test_fog_lowers_contrast_and_stays_in_range():
    x = rng(2).uniform(size=(224, 224, 3))
    y = fog(x, 3, rng(3))
    assert 0.0 <= y.min() and y.max() <= 1.0
    assert y.std() < 0.5 * x.std()


def test_plasma_fractal_is_a_normalised_non_constant_map():
    grid = plasma_fractal(256, 1.7, rng())
    assert grid.shape == (256, 256) and grid.min() == 0.0 and grid.max() == 1.0
    assert grid.std() > 0.05
    with pytest.raises(ValueError, match="power of two"):
        plasma_fractal(100, 1.7, rng())


def test_corrupted_dataset_is_deterministic_per_index_and_keeps_labels():
    images = [{"image": Image.fromarray(np.full((28, 28), 40 * i, dtype=np.uint8)), "label": i} for i in range(3)]
    dataset = CorruptedImageDataset(images, "gaussian_noise", severity=3, seed=7)
    first, again, other = dataset[1], dataset[1], dataset[2]
    assert first["label"] == 1 and first["image"].size == (224, 224) and first["image"].mode == "RGB"
    assert np.array_equal(np.asarray(first["image"]), np.asarray(again["image"]))
    noise_1 = np.asarray(first["image"], dtype=float) - 40
    noise_2 = np.asarray(other["image"], dtype=float) - 80
    assert not np.allclose(noise_1, noise_2)
    assert images[1]["image"].size == (28, 28), "the source dataset is untouched"


def test_bad_corruption_arguments_are_named():
    with pytest.raises(ValueError, match="unknown corruption 'snow'"):
        CorruptedImageDataset([], "snow")
    with pytest.raises(ValueError, match="severity must be an integer in 1..5"):
        CorruptedImageDataset([], "fog", severity=6)
    with pytest.raises(ValueError, match="unknown corruption"):
        corrupt(Image.new("RGB", (8, 8)), "frost", 3, rng())
