"""A folder of images per class (``root/<class>/<image>``), or a flat folder of unlabeled images.

Images are read with Pillow, converted to grayscale or RGB as the source says, and scaled to
[0, 1]. They are all of one size, ``source.size`` (height, width): declared, or for an owner's
folder the public pool's (``DataSource.sized``), never taken from the folder itself, so one
image cannot decide which others are kept. An image of another size makes its row unusable
(``RawData.unusable``), as does a file that is not a readable image; a resize would be a
modelling choice to make in the config, not here. Without a size (public data only) the images
must all have the same one. Files are taken in sorted order so a folder reads the same everywhere.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from conclave.learning.data.dataset import DataFormatError
from conclave.learning.data.sources import DataSource, RawData

SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def read_image_folder(source: DataSource) -> RawData:
    root = Path(source.path)
    files = _files(root)
    labelled = files[0][1] is not None
    arrays: list[np.ndarray | None] = []
    unusable: dict[int, str] = {}
    for row, (path, _) in enumerate(files):
        pixels, why = _read(path, source.channels, source.size)
        arrays.append(pixels)
        if why:
            unusable[row] = f"{path.name}: {why}"
    size = source.size
    if size is None:
        sizes = {a.shape[1:] for a in arrays if a is not None}
        if len(sizes) != 1:
            raise DataFormatError(f"{root}: " + ("no readable images" if not sizes else
                                                  f"images of different sizes {sorted(sizes)[:3]}; make them one size"))
        size = next(iter(sizes))
    blank = np.zeros((source.channels, *size), dtype=np.uint8)
    x = np.stack([blank if a is None else a for a in arrays]).astype(np.float32) / 255.0
    labels = np.array([label for _, label in files]) if labelled else None
    return RawData(x, labels, unusable)


def folder_image_size(source: DataSource) -> tuple[int, int]:
    """The size (height, width) of the folder's first readable image: for public data, whose
    images are all of one size (``read`` refuses it otherwise), the size of them all."""
    for path, _ in _files(Path(source.path)):
        pixels, _ = _read(path, source.channels, None)
        if pixels is not None:
            return pixels.shape[1], pixels.shape[2]
    raise DataFormatError(f"{source.path}: no readable images")


def _files(root: Path) -> list[tuple[Path, str | None]]:
    """Each image file with its class folder's name (None in a flat folder), in sorted order."""
    if not root.is_dir():
        raise DataFormatError(f"{root}: an image source is a folder")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir())
    files = [(f, d.name) for d in class_dirs for f in _images(d)] if class_dirs else \
        [(f, None) for f in _images(root)]
    if not files:
        raise DataFormatError(f"{root}: no images ({', '.join(sorted(SUFFIXES))}) found")
    return files


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)


def _read(path: Path, channels: int, size: tuple[int, int] | None) -> tuple[np.ndarray | None, str | None]:
    """The image's pixels ``[C, H, W]``, or None and why it is unusable: not a readable image, or
    not of ``size`` (checked from its header, before its pixels are decoded)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            width, height = image.size
            if size is not None and (height, width) != tuple(size):
                return None, f"a {height}×{width} image, not the run's {size[0]}×{size[1]}"
            pixels = np.asarray(image.convert("L" if channels == 1 else "RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError):
        return None, "not a readable image"
    return (pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)), None
