"""ImageNet-C corruptions (Hendrycks & Dietterich, ICLR 2019) for corrupted-calibration runs (paper Table 6).

Gaussian noise, motion blur and fog with ImageNet-C's per-severity constants, on float images in [0, 1] at
ImageNet-C's 224 x 224 resolution (the paper's CLIP inputs); the model's processor resizes afterwards.
Written here because the packaged port (`imagecorruptions` 1.1.2) no longer imports on current stacks
(it needs `pkg_resources` and NumPy 1's `np.float_`). Motion blur follows that port's Wand-free kernel (a
one-sided Gaussian along a random direction, edge pixels replicated); fog is its diamond-square plasma fractal.

``CorruptedImageDataset`` wraps an image-classification dataset (``{"image", "label"}`` items) so that only
the calibration stream is corrupted: give it to a method through ``calibration_datasets``.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Dict

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

SIZE = 224

GAUSSIAN_NOISE = (0.08, 0.12, 0.18, 0.26, 0.38)
MOTION_BLUR = ((10, 3), (15, 5), (15, 8), (15, 12), (20, 15))  # (radius, sigma)
FOG = ((1.5, 2.0), (2.0, 2.0), (2.5, 1.7), (2.5, 1.5), (3.0, 1.4))  # (strength, wibble decay)


def check_severity(severity: int) -> None:
    if not isinstance(severity, int) or isinstance(severity, bool) or not 1 <= severity <= 5:
        raise ValueError(f"severity must be an integer in 1..5, got {severity!r}")


def _level(table, severity: int):
    check_severity(severity)
    return table[severity - 1]


def gaussian_noise(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    return np.clip(x + rng.normal(scale=_level(GAUSSIAN_NOISE, severity), size=x.shape), 0.0, 1.0)


def _shift(image: np.ndarray, dx: int, dy: int) -> np.ndarray:
    """Translate by (dx, dy) pixels, replicating the edge into the uncovered border."""
    height, width = image.shape[:2]
    rows = np.clip(np.arange(height) - dy, 0, height - 1)
    cols = np.clip(np.arange(width) - dx, 0, width - 1)
    return image[rows][:, cols]


def motion_blur(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    radius, sigma = _level(MOTION_BLUR, severity)
    width = 2 * radius + 1
    kernel = np.exp(-np.arange(width) ** 2 / (2 * sigma**2))
    kernel /= kernel.sum()
    angle = np.deg2rad(rng.uniform(-45, 45))
    step_y, step_x = math.sin(angle), math.cos(angle)
    blurred = np.zeros_like(x)
    for i in range(width):
        dy, dx = -math.ceil(i * step_y - 0.5), -math.ceil(i * step_x - 0.5)
        if abs(dy) >= x.shape[0] or abs(dx) >= x.shape[1]:
            break
        blurred += kernel[i] * _shift(x, dx, dy)
    return np.clip(blurred, 0.0, 1.0)


def plasma_fractal(size: int, decay: float, rng: np.random.Generator) -> np.ndarray:
    """Diamond-square height map of side ``size`` (a power of two), scaled to [0, 1]."""
    if size & (size - 1):
        raise ValueError(f"the fractal's side must be a power of two, got {size}")
    grid = np.zeros((size, size))
    step, wibble = size, 100.0

    def noisy_mean(total):
        return total / 4 + wibble * rng.uniform(-wibble, wibble, total.shape)

    while step >= 2:
        half = step // 2
        corners = grid[0:size:step, 0:size:step]
        squares = corners + np.roll(corners, -1, axis=0)
        squares = squares + np.roll(squares, -1, axis=1)
        grid[half:size:step, half:size:step] = noisy_mean(squares)
        centres = grid[half:size:step, half:size:step]
        corners = grid[0:size:step, 0:size:step]
        grid[0:size:step, half:size:step] = noisy_mean(
            centres + np.roll(centres, 1, axis=0) + corners + np.roll(corners, -1, axis=1)
        )
        grid[half:size:step, 0:size:step] = noisy_mean(
            centres + np.roll(centres, 1, axis=1) + corners + np.roll(corners, -1, axis=0)
        )
        step //= 2
        wibble /= decay
    grid -= grid.min()
    return grid / grid.max()


def fog(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    strength, decay = _level(FOG, severity)
    size = 1 << (max(x.shape[:2]) - 1).bit_length()
    peak = x.max()
    fogged = x + strength * plasma_fractal(size, decay, rng)[: x.shape[0], : x.shape[1], None]
    return np.clip(fogged * peak / (peak + strength), 0.0, 1.0)


CORRUPTIONS: Dict[str, Callable[[np.ndarray, int, np.random.Generator], np.ndarray]] = {
    "gaussian_noise": gaussian_noise,
    "motion_blur": motion_blur,
    "fog": fog,
}


def corrupt(image: Image.Image, corruption: str, severity: int, rng: np.random.Generator) -> Image.Image:
    """The corrupted RGB image at ImageNet-C's 224 x 224."""
    if corruption not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {corruption!r}; known: {', '.join(CORRUPTIONS)}")
    x = np.asarray(image.convert("RGB").resize((SIZE, SIZE), Image.BILINEAR), dtype=np.float64) / 255.0
    y = CORRUPTIONS[corruption](x, severity, rng)
    return Image.fromarray(np.round(y * 255.0).astype(np.uint8))


class CorruptedImageDataset(Dataset):
    """``dataset`` with every image corrupted, the same way every time an index is read (seeded by index)."""

    def __init__(self, dataset, corruption: str, severity: int = 3, seed: int = 0):
        if corruption not in CORRUPTIONS:
            raise ValueError(f"unknown corruption {corruption!r}; known: {', '.join(CORRUPTIONS)}")
        check_severity(severity)
        self.dataset = dataset
        self.corruption = corruption
        self.severity = severity
        self.seed = [seed, zlib.crc32(corruption.encode())]
        self._cache = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        index = int(index)
        if index not in self._cache:
            # Seeded by index, so keeping the result is exact; streamed calibrators (Surgery) read each example many
            # times, and a 224 x 224 motion blur is 31 shifted copies of the image.
            item = dict(self.dataset[index])
            rng = np.random.default_rng([*self.seed, index])
            item["image"] = corrupt(item["image"], self.corruption, self.severity, rng)
            self._cache[index] = item
        return dict(self._cache[index])


__all__ = ["CORRUPTIONS", "CorruptedImageDataset", "check_severity", "corrupt", "fog", "gaussian_noise", "motion_blur", "plasma_fractal"]
