"""The benchmark data sets: ``synthetic``, ``usps_784`` (real digits at MNIST's size) and the
UCI sets that ``benchmarks/prepare_uci.py`` writes (letters, Shuttle, Satellite)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

USPS_PATH = Path(__file__).resolve().parents[3] / "shared" / "data" / "usps.npz"


def synthetic(n: int, n_features: int = 784, n_classes: int = 10, seed: int = 0, latent: int = 40):
    """Multimodal classes in a low-dimensional subspace of a high-dimensional space.

    Each class is a mixture of 3 Gaussian blobs in a `latent`-dim subspace (so the classes are
    not linearly separable by their means alone), embedded by a random orthonormal map into
    `n_features` dims, plus isotropic noise. Raw-input 1-NN accuracy is about 0.65 and PCA-32's
    about 0.72 at N = 10k, so there is room for a learned metric. Returns X (n, D) float32 and
    y (n,) int64.
    """
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1.0, size=(n_classes, 3, latent))
    y = rng.integers(0, n_classes, n)
    mode = rng.integers(0, 3, n)
    z = centres[y, mode] + rng.normal(0, 1.5, size=(n, latent))
    basis, _ = np.linalg.qr(rng.normal(size=(n_features, latent)))
    X = z @ basis.T + rng.normal(0, 0.5, size=(n, n_features))
    return X.astype(np.float32), y


def usps_784(n: int, n_validation: int, n_test: int, seed: int = 0):
    """Real digits at MNIST's size: USPS resampled to 28 x 28 and augmented to `n` references.

    Each 16 x 16 USPS image is zoomed to 20 x 20 and centred on a 28 x 28 canvas (MNIST's
    format, D = 784), then moved by a random small affine map (rotation within +-12 degrees,
    scale 0.9-1.1, shift within +-2 px; bilinear). References come from 6,291 USPS training
    images, validation queries from the other 1,000 training images, test queries from the
    2,007 USPS test images, so no query is an augmented copy of a reference's source image.
    Returns (X_ref, y_ref, X_val, y_val, X_test, y_test), X float32 in [0, 1], y int64, or
    None when ../shared/data/usps.npz is absent.
    """
    if not USPS_PATH.exists():
        return None
    from scipy import ndimage  # scipy comes with the train extra; the serving benchmarks lack it

    data = np.load(USPS_PATH)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(data["y"]))
    train_images, train_labels = data["X"][order], data["y"][order]

    def canvas(images: np.ndarray) -> np.ndarray:  # (m, 256) -> (m, 28, 28)
        small = images.reshape(-1, 16, 16)
        big = ndimage.zoom(small, (1, 20 / 16, 20 / 16), order=1)
        out = np.zeros((len(images), 28, 28), dtype=np.float32)
        out[:, 4:24, 4:24] = np.clip(big, 0, 1)
        return out

    def augment(images: np.ndarray, labels: np.ndarray, count: int):
        base = canvas(images)
        pick = rng.integers(0, len(images), count)
        out = np.empty((count, 784), dtype=np.float32)
        centre = np.array([13.5, 13.5])
        for row, source in enumerate(pick):
            angle = np.deg2rad(rng.uniform(-12, 12))
            scale = rng.uniform(0.9, 1.1)
            rotation = (
                np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]]) / scale
            )
            shift = rng.uniform(-2, 2, size=2)
            offset = centre - rotation @ (centre + shift)
            moved = ndimage.affine_transform(base[source], rotation, offset=offset, order=1)
            out[row] = moved.reshape(784)
        return out, labels[pick].astype(np.int64)

    X_ref, y_ref = augment(train_images[1000:], train_labels[1000:], n)
    X_val, y_val = augment(train_images[:1000], train_labels[:1000], n_validation)
    X_test, y_test = augment(data["X_test"], data["y_test"], n_test)
    return X_ref, y_ref, X_val, y_val, X_test, y_test


UCI_FOLDER = Path(__file__).resolve().parents[1] / "data"  # benchmarks/prepare_uci.py writes
LETTERS_PATH = UCI_FOLDER / "letter-recognition.npz"
SHUTTLE_PATH = UCI_FOLDER / "shuttle.npz"
SATELLITE_PATH = UCI_FOLDER / "satellite.npz"
MLBENCH_PACKAGE = "r-cran-mlbench"  # Debian's R mlbench, which ships these UCI sets


def letters(n_validation: int = 1600, seed: int = 0):
    """UCI's letter recognition (Frey and Slate 1991): 20,000 rows of 16 integer features,
    26 classes. The first 16,000 rows train, as UCI's description says (``n_validation`` of
    them, drawn with ``seed``, validate), and the last 4,000 test. Returns (X_ref, y_ref,
    X_val, y_val, X_test, y_test), X float32, y int64 (A = 0), or None when
    ``benchmarks/prepare_uci.py`` has not written ``benchmarks/data/letter-recognition.npz``.
    """
    if not LETTERS_PATH.exists():
        return None
    data = np.load(LETTERS_PATH)
    X, y = data["X"].astype(np.float32), data["y"].astype(np.int64)
    order = np.random.default_rng(seed).permutation(16000)
    validation, train = order[:n_validation], order[n_validation:]
    return X[train], y[train], X[validation], y[validation], X[16000:], y[16000:]


def uci_split(path: Path, n_train: int):
    """(X_train, y_train, X_test, y_test) of a set that ``benchmarks/prepare_uci.py`` wrote,
    UCI's training file its first ``n_train`` rows; X float32, y int64. None when it has not
    been written."""
    if not path.exists():
        return None
    data = np.load(path)
    X, y = data["X"].astype(np.float32), data["y"].astype(np.int64)
    return X[:n_train], y[:n_train], X[n_train:], y[n_train:]


def shuttle():
    """UCI's Shuttle (Statlog): 43,500 training rows of 9 integer features in 7 classes of
    34,108, 37, 132, 6,748, 2,458, 6 and 11 rows, and 14,500 test rows."""
    return uci_split(SHUTTLE_PATH, 43500)


def satellite():
    """UCI's Satellite (Statlog Landsat): 4,435 training rows of 36 integer features (3 x 3
    pixels in 4 spectral bands) in 6 classes, and 2,000 test rows."""
    return uci_split(SATELLITE_PATH, 4435)
