"""Data sources, splits and shards.

Readers are checked on small files written here in the exact published formats (IDX,
CIFAR python pickles with bytes keys, SVHN MATLAB files), and MNIST on the real files.
"""
from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import scipy.io

from conclave.learning.data import (
    DataFormatError, Dataset, load_cifar, load_dataset, load_digits, load_mnist, load_svhn,
    make_splits, read_idx, shard, split_datasets,
)

# ---------------------------------------------------------------- writers in the real formats


def write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    """IDX: 0x00 0x00, type 0x08 (ubyte), ndim, big-endian uint32 dims, then the bytes."""
    payload = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload += array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(payload) if compress else payload)


def write_mnist(root: Path, n_train: int = 12, n_test: int = 7, seed: int = 0,
                compress_train: bool = True, compress_test: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    root.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        compress = compress_train if name.startswith("train") else compress_test
        write_idx(root / (name + ".gz" if compress else name), array, compress)
    return arrays


def write_cifar_batch(path: Path, data: np.ndarray, labels: list[int], label_key: bytes,
                      protocol: int) -> None:
    batch = {b"batch_label": b"testing batch", label_key: labels, b"data": data,
             b"filenames": [b"img%d.png" % i for i in range(len(labels))]}
    if label_key == b"fine_labels":
        batch[b"coarse_labels"] = [label // 5 for label in labels]
    path.write_bytes(pickle.dumps(batch, protocol=protocol))


def cifar_arrays(n: int, num_classes: int, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            [int(v) for v in rng.integers(0, num_classes, n)])


def write_svhn(root: Path, n_train: int = 9, n_test: int = 5) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    written = {}
    for name, n in (("train_32x32.mat", n_train), ("test_32x32.mat", n_test)):
        images = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        labels = rng.integers(1, 11, (n, 1)).astype(np.uint8)
        labels[0, 0] = 10  # make sure the "10 means 0" case is present
        scipy.io.savemat(root / name, {"X": images, "y": labels})
        written[name] = (images, labels)
    return written


def indexed_dataset(n: int, num_classes: int = 3, name: str = "toy") -> Dataset:
    """A dataset whose first pixel identifies each example, to check who went where."""
    x = np.zeros((n, 1, 2, 2), dtype=np.float32)
    x[:, 0, 0, 0] = np.arange(n) / n
    return Dataset(x, (np.arange(n) % num_classes).astype(np.int64), num_classes, name)


def ids(dataset: Dataset, n: int) -> np.ndarray:
    return np.rint(dataset.x[:, 0, 0, 0] * n).astype(np.int64)


# ---------------------------------------------------------------- Dataset


def test_dataset_rejects_wrong_layouts():
    x = np.zeros((4, 1, 8, 8), dtype=np.float32)
    y = np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="float32"):
        Dataset(x.astype(np.float64), y, 10, "d")
    with pytest.raises(ValueError, match=r"\[n, C, H, W\]"):
        Dataset(x[:, 0], y, 10, "d")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        Dataset(x + 2.0, y, 10, "d")
    with pytest.raises(ValueError, match="finite"):
        Dataset(np.full_like(x, np.nan), y, 10, "d")
    with pytest.raises(ValueError, match="int64"):
        Dataset(x, y.astype(np.int32), 10, "d")
    with pytest.raises(ValueError, match="4 images but 3 labels"):
        Dataset(x, y[:3], 10, "d")
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
        Dataset(x, np.array([0, 1, 10, 2]), 10, "d")
    subset = Dataset(x, np.arange(4, dtype=np.int64), 10, "d").subset([3, 1])
    assert subset.y.tolist() == [3, 1] and len(subset) == 2 and subset.input_shape == (1, 8, 8)
    assert repr(subset) == "Dataset(name='d', n=2, input_shape=(1, 8, 8), num_classes=10)"


# ---------------------------------------------------------------- digits


def test_digits_is_bundled_scaled_and_split_deterministically():
    train, test = load_digits()
    again_train, again_test = load_digits()
    assert train.x.shape == (1297, 1, 8, 8) and test.x.shape == (500, 1, 8, 8)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64
    assert train.x.min() == 0.0 and train.x.max() == 1.0  # 0..16 → /16
    assert np.array_equal(train.x, again_train.x) and np.array_equal(test.y, again_test.y)
    # every one of the 1,797 images is in exactly one part: compare as a multiset of rows
    from sklearn.datasets import load_digits as sk_digits
    original = sk_digits().images.reshape(len(train) + len(test), -1) / 16.0
    ours = np.concatenate([train.x, test.x]).reshape(len(original), -1)
    assert np.array_equal(np.unique(original, axis=0), np.unique(ours, axis=0))
    assert set(np.unique(test.y)) == set(range(10))


def test_digits_are_scikit_learns_arrays_read_without_importing_scikit_learn():
    """The bundled file is read directly (importing scikit-learn took 1.3 s of CPU in every Ray
    worker that loads the digits): the same images and labels as ``sklearn.datasets.load_digits``."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    train, test = load_digits()
    order = np.random.default_rng(0).permutation(len(bunch.target))  # the split's definition
    for part, rows in ((train, np.sort(order[500:])), (test, np.sort(order[:500]))):
        assert np.array_equal(part.x, (bunch.images.astype(np.float32) / 16.0)[rows, None])
        assert np.array_equal(part.y, bunch.target[rows].astype(np.int64))
    probe = "import sys; from conclave.learning.data import load_digits; load_digits(); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"


# ---------------------------------------------------------------- MNIST IDX


def test_mnist_round_trip_gz_and_raw(tmp_path):
    arrays = write_mnist(tmp_path / "anywhere" / "mnist", compress_train=True, compress_test=False)
    train, test = load_mnist(tmp_path / "anywhere" / "mnist")
    assert train.x.shape == (12, 1, 28, 28) and test.x.shape == (7, 1, 28, 28)
    assert np.array_equal(np.rint(train.x[:, 0] * 255), arrays["train-images-idx3-ubyte"])
    assert np.array_equal(np.rint(test.x[:, 0] * 255), arrays["t10k-images-idx3-ubyte"])
    assert np.array_equal(train.y, arrays["train-labels-idx1-ubyte"])
    assert np.array_equal(test.y, arrays["t10k-labels-idx1-ubyte"])
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64 and train.num_classes == 10


def test_read_idx_checks_magic_dimensions_and_size(tmp_path):
    path = tmp_path / "labels-idx1-ubyte"
    write_idx(path, np.arange(5, dtype=np.uint8), compress=False)
    assert read_idx(path, ndim=1).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(DataFormatError, match="magic"):
        read_idx(path, ndim=3)  # a label file where images are expected
    raw = path.read_bytes()
    path.write_bytes(b"\x00\x00\x0d\x01" + raw[4:])  # type 0x0d = float, not ubyte
    with pytest.raises(DataFormatError, match="magic"):
        read_idx(path, ndim=1)
    path.write_bytes(raw[:-1])
    with pytest.raises(DataFormatError, match="4 bytes|promises"):
        read_idx(path, ndim=1)
    path.write_bytes(raw[:6])
    with pytest.raises(DataFormatError, match="too short"):
        read_idx(path, ndim=1)


@pytest.mark.parametrize("damage", ["missing", "truncated", "bad_gzip", "bad_magic"])
def test_mnist_damaged_file_is_an_error_naming_it(tmp_path, damage):
    write_mnist(tmp_path, compress_train=True, compress_test=True)
    target = tmp_path / "t10k-labels-idx1-ubyte.gz"
    if damage == "missing":
        target.unlink()
        error = FileNotFoundError
    elif damage == "truncated":
        raw = gzip.decompress(target.read_bytes())
        target.write_bytes(gzip.compress(raw[:-2]))
        error = DataFormatError
    elif damage == "bad_gzip":
        target.write_bytes(b"this is not gzip data at all")
        error = DataFormatError
    else:
        raw = gzip.decompress(target.read_bytes())
        target.write_bytes(gzip.compress(b"\x00\x00\x08\x03" + raw[4:]))
        error = DataFormatError
    with pytest.raises(error, match="t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path)


def test_mnist_count_mismatch_and_bad_labels(tmp_path):
    arrays = write_mnist(tmp_path, compress_train=False, compress_test=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", arrays["train-labels-idx1-ubyte"][:-1], False)
    with pytest.raises(DataFormatError, match="12 images .* 11 labels"):
        load_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.full(12, 11, dtype=np.uint8), False)
    with pytest.raises(DataFormatError, match="train-labels-idx1-ubyte: label 11"):
        load_mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mnist(tmp_path / "nowhere")


@pytest.fixture(scope="module")
def real_mnist(mnist_dir):
    return load_dataset("mnist", mnist_dir)


def test_real_mnist(real_mnist):
    train, test = real_mnist
    assert train.x.shape == (60000, 1, 28, 28) and test.x.shape == (10000, 1, 28, 28)
    assert train.x.min() == 0.0 and train.x.max() == 1.0
    # published class frequencies of the MNIST training and test sets
    assert np.bincount(train.y).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert np.bincount(test.y).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert train.y[:5].tolist() == [5, 0, 4, 1, 9] and test.y[:3].tolist() == [7, 2, 1]


def test_load_dataset_by_name(tmp_path):
    assert len(load_dataset("digits")[0]) == 1297
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
        load_dataset("imagenet", tmp_path)
    with pytest.raises(ValueError, match="give the directory"):
        load_dataset("mnist")


# ---------------------------------------------------------------- CIFAR pickles


def test_cifar10_round_trip(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    written = []
    for i, name in enumerate([f"data_batch_{j}" for j in range(1, 6)] + ["test_batch"]):
        data, labels = cifar_arrays(3 + i, 10, seed=i)
        # the published files are Python 2 pickles (protocol 2); numpy 2 writes protocol 5
        write_cifar_batch(folder / name, data, labels, b"labels", protocol=2 if i % 2 else 5)
        written.append((data, labels))
    for root in (tmp_path, folder):  # the parent directory or the dataset folder itself
        train, test = load_cifar(root, num_classes=10)
        assert train.x.shape == (3 + 4 + 5 + 6 + 7, 3, 32, 32) and test.x.shape == (8, 3, 32, 32)
        data = np.concatenate([d for d, _ in written[:5]])
        assert train.y.tolist() == sum((labels for _, labels in written[:5]), [])
        # one row is 1,024 red values, then green, then blue, each row-major
        assert train.x[4, 1, 2, 3] == np.float32(data[4, 1024 + 2 * 32 + 3]) / 255
        assert np.array_equal(np.rint(train.x.reshape(len(train), -1) * 255), data)
        assert np.array_equal(np.rint(test.x.reshape(8, -1) * 255), written[5][0])
        assert test.num_classes == 10 and test.name == "cifar10/test"


def test_cifar100_round_trip(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    train_data, train_labels = cifar_arrays(10, 100, seed=1)
    train_labels[0] = 99
    test_data, test_labels = cifar_arrays(4, 100, seed=2)
    write_cifar_batch(folder / "train", train_data, train_labels, b"fine_labels", protocol=2)
    write_cifar_batch(folder / "test", test_data, test_labels, b"fine_labels", protocol=2)
    train, test = load_dataset("cifar100", tmp_path)
    assert train.num_classes == 100 and train.y.tolist() == train_labels
    assert np.array_equal(np.rint(test.x.reshape(4, -1) * 255), test_data)


def test_cifar_damaged_files_name_the_file(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i, name in enumerate([f"data_batch_{j}" for j in range(1, 6)] + ["test_batch"]):
        write_cifar_batch(folder / name, *cifar_arrays(2, 10, seed=i), b"labels", protocol=2)
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        load_cifar(tmp_path)
    (folder / "data_batch_3").write_bytes(b"\x80\x02garbage")
    with pytest.raises(DataFormatError, match="data_batch_3"):
        load_cifar(tmp_path)
    write_cifar_batch(folder / "data_batch_3", *cifar_arrays(2, 10, seed=0), b"fine_labels", protocol=2)
    with pytest.raises(DataFormatError, match="data_batch_3.*b'labels'"):
        load_cifar(tmp_path)
    write_cifar_batch(folder / "data_batch_3", np.zeros((2, 100), np.uint8), [0, 1], b"labels", protocol=2)
    with pytest.raises(DataFormatError, match="data_batch_3.*uint8"):
        load_cifar(tmp_path)
    write_cifar_batch(folder / "data_batch_3", np.zeros((2, 3072), np.uint8), [0, 10], b"labels", protocol=2)
    with pytest.raises(DataFormatError, match="data_batch_3.*labels outside"):
        load_cifar(tmp_path)
    with pytest.raises(ValueError, match="10 or 100"):
        load_cifar(tmp_path, num_classes=20)


class _Exploit:
    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_cifar_pickle_cannot_run_code(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    exploit = _Exploit()
    exploit.target = str(tmp_path / "pwned")
    (folder / "data_batch_1").write_bytes(pickle.dumps({b"data": exploit, b"labels": []}))
    with pytest.raises(DataFormatError, match="data_batch_1.*refusing"):
        load_cifar(tmp_path)
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------- SVHN .mat


def test_svhn_round_trip(tmp_path):
    written = write_svhn(tmp_path)
    train, test = load_svhn(tmp_path)
    images, labels = written["train_32x32.mat"]
    assert train.x.shape == (9, 3, 32, 32) and test.x.shape == (5, 3, 32, 32)
    # X is [height, width, channel, example]
    assert train.x[2, 1, 5, 7] == np.float32(images[5, 7, 1, 2]) / 255
    assert np.array_equal(np.rint(train.x * 255), images.transpose(3, 2, 0, 1))
    expected = labels[:, 0].astype(np.int64)
    expected[expected == 10] = 0
    assert train.y.tolist() == expected.tolist() and train.y[0] == 0
    assert train.y.dtype == np.int64 and train.x.flags["C_CONTIGUOUS"]


def test_svhn_damaged_files_name_the_file(tmp_path):
    write_svhn(tmp_path)
    (tmp_path / "test_32x32.mat").write_bytes(b"MATLAB? no.")
    with pytest.raises(DataFormatError, match="test_32x32.mat"):
        load_svhn(tmp_path)
    (tmp_path / "test_32x32.mat").unlink()
    with pytest.raises(FileNotFoundError, match="test_32x32.mat"):
        load_svhn(tmp_path)
    scipy.io.savemat(tmp_path / "test_32x32.mat",
                     {"X": np.zeros((32, 32, 3, 2), np.uint8), "y": np.array([[0], [3]], np.uint8)})
    with pytest.raises(DataFormatError, match=r"test_32x32.mat: labels must lie in 1..10"):
        load_svhn(tmp_path)
    scipy.io.savemat(tmp_path / "test_32x32.mat",
                     {"X": np.zeros((28, 28, 1, 2), np.uint8), "y": np.array([[1], [3]], np.uint8)})
    with pytest.raises(DataFormatError, match=r"test_32x32.mat: X must be uint8 \[32, 32, 3, n\]"):
        load_svhn(tmp_path)


# ---------------------------------------------------------------- splits and shards


def test_splits_follow_pate_convention_and_are_deterministic():
    train, test = indexed_dataset(50, name="train"), indexed_dataset(40, name="test")
    splits = split_datasets(train, test, public_size=15, seed=7)
    assert ids(splits.private, 50).tolist() == list(range(50))  # private = the whole train set
    public, rest = ids(splits.public, 40), ids(splits.test, 40)
    assert len(public) == 15 and len(rest) == 25
    assert set(public).isdisjoint(rest) and set(public) | set(rest) == set(range(40))
    # public = the first public_size of the seeded shuffle of the test set
    assert public.tolist() == np.random.default_rng(7).permutation(40)[:15].tolist()
    again = split_datasets(train, test, public_size=15, seed=7)
    assert np.array_equal(again.public.x, splits.public.x) and np.array_equal(again.test.y, splits.test.y)
    other = split_datasets(train, test, public_size=15, seed=8)
    assert not np.array_equal(ids(other.public, 40), public)
    assert np.array_equal(splits.public.y, test.y[public])  # labels travel with their images


def test_private_size_subsamples_the_train_set():
    train, test = indexed_dataset(50), indexed_dataset(40)
    splits = split_datasets(train, test, public_size=10, seed=3, private_size=20)
    chosen = ids(splits.private, 50)
    assert len(set(chosen)) == 20 and set(chosen) <= set(range(50))
    assert chosen.tolist() == sorted(chosen)
    assert np.array_equal(chosen, ids(split_datasets(train, test, public_size=10, seed=3,
                                                     private_size=20).private, 50))
    with pytest.raises(ValueError, match="private_size"):
        split_datasets(train, test, public_size=10, seed=3, private_size=51)
    for bad in (0, 40):
        with pytest.raises(ValueError, match="public_size"):
            split_datasets(train, test, public_size=bad, seed=3)


def test_make_splits_on_digits():
    splits = make_splits("digits", public_size=300, seed=0)
    assert (len(splits.private), len(splits.public), len(splits.test)) == (1297, 300, 200)
    again = make_splits("digits", public_size=300, seed=0)
    assert np.array_equal(splits.public.x, again.public.x)
    rows = lambda d: {r.tobytes() for r in d.x}  # noqa: E731
    assert rows(splits.public).isdisjoint(rows(splits.test))


def test_the_student_side_of_splits_has_no_private_split():
    splits = make_splits("digits", public_size=300, seed=0)
    student = splits.student_side()
    assert (student.public, student.test) == (splits.public, splits.test)
    assert not hasattr(student, "private")


@pytest.mark.parametrize("n, num_shards", [(100, 7), (250, 250), (10, 1), (1297, 250), (20000, 10)])
def test_shards_are_disjoint_cover_everything_and_balanced_on_average(n, num_shards):
    dataset = indexed_dataset(n)
    shards = shard(dataset, num_shards, seed=5)
    members = [ids(s, n) for s in shards]
    assert len(shards) == num_shards
    assert sorted(np.concatenate(members).tolist()) == list(range(n))  # disjoint and covering
    sizes = np.array([len(s) for s in shards])
    mean = n / num_shards  # multinomial sizes: within 6 standard deviations of the mean
    assert np.all(np.abs(sizes - mean) <= 6 * np.sqrt(mean * (1 - 1 / num_shards)) + 1)
    assert all(np.array_equal(s.y, dataset.y[m]) for s, m in zip(shards, members))
    assert all(np.all(np.diff(m) > 0) for m in members)  # source order kept
    again = shard(dataset, num_shards, seed=5)
    assert all(np.array_equal(a.x, b.x) for a, b in zip(shards, again))
    if num_shards > 1:
        assert not all(np.array_equal(a.x, b.x) for a, b in zip(shards, shard(dataset, num_shards, seed=6)))


def test_adding_or_removing_one_record_changes_exactly_one_shard():
    dataset = indexed_dataset(300)
    before = shard(dataset, 25, seed=9)
    extra = indexed_dataset(301).subset([300])  # a record not in the dataset
    grown = Dataset(np.concatenate([dataset.x, extra.x]), np.concatenate([dataset.y, extra.y]),
                    dataset.num_classes, dataset.name)
    after = shard(grown, 25, seed=9)
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if not np.array_equal(a.x, b.x)]
    assert len(changed) == 1 and len(after[changed[0]]) == len(before[changed[0]]) + 1
    for removed in (0, 137, 299):
        smaller = dataset.subset(np.delete(np.arange(300), removed))
        after = shard(smaller, 25, seed=9)
        changed = [i for i, (a, b) in enumerate(zip(before, after)) if not np.array_equal(a.x, b.x)]
        assert len(changed) == 1 and len(after[changed[0]]) == len(before[changed[0]]) - 1


def test_shard_rejects_impossible_counts_and_leaves_shards_empty_when_records_are_few():
    parts = shard(indexed_dataset(5), 8, seed=0)  # fewer records than shards depends on the data: no error
    assert len(parts) == 8 and sum(map(len, parts)) == 5 and any(len(p) == 0 for p in parts)
    with pytest.raises(ValueError, match="num_shards"):
        shard(indexed_dataset(5), 0, seed=0)


def test_a_shard_over_its_cap_keeps_a_random_subset_of_its_own_records():
    from conclave.learning.data.dataset import cap_shard, shard_cap

    part = indexed_dataset(50)
    assert shard_cap(100, 10) == 20  # 10 + 3·√10 = 19.5, rounded up
    kept = cap_shard(part, 20, np.random.default_rng())
    ids = kept.x[:, 0, 0, 0]
    assert len(kept) == 20 and set(ids.tolist()) <= set(part.x[:, 0, 0, 0].tolist())
    assert np.all(np.diff(ids) > 0)  # source order kept
    assert cap_shard(part, 50, np.random.default_rng()) is part
