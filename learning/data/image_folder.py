"""A folder of images per class (``root/<class>/<image>``), or a flat folder of unlabeled images.

Images are read with Pillow, converted to grayscale or RGB as the source says, and scaled to
[0, 1]; they must all have the same size (a resize would be a modelling choice to make in the
config, not here). Files are taken in sorted order so a folder reads the same everywhere.
A file that is not a readable image makes its row unusable (``RawData.unusable``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from conclave.learning.data.dataset import DataFormatError
from conclave.learning.data.sources import DataSource, RawData

SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def read_image_folder(source: DataSource) -> RawData:
    root = Path(source.path)
    if not root.is_dir():
        raise DataFormatError(f"{root}: an image source is a folder")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir())
    if class_dirs:
        files = [(f, d.name) for d in class_dirs for f in _images(d)]
    else:
        files = [(f, None) for f in _images(root)]
    if not files:
        raise DataFormatError(f"{root}: no images ({', '.join(sorted(SUFFIXES))}) found")
    arrays = [_read(path, source.channels) for path, _ in files]
    unusable = {row: f"{files[row][0].name}: not a readable image" for row, a in enumerate(arrays) if a is None}
    sizes = {a.shape for a in arrays if a is not None}
    if len(sizes) != 1:
        raise DataFormatError(f"{root}: " + ("no readable images" if not sizes else
                                              f"images of different sizes {sorted(sizes)[:3]}; make them one size"))
    blank = np.zeros(next(iter(sizes)), dtype=np.uint8)
    x = np.stack([blank if a is None else a for a in arrays]).astype(np.float32) / 255.0
    labels = np.array([label for _, label in files]) if class_dirs else None
    return RawData(x.astype(np.float32), labels, unusable)


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)


def _read(path: Path, channels: int) -> np.ndarray | None:
    """The image's pixels, or None when the file is not a readable image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("L" if channels == 1 else "RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError):
        return None
    return pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)
