"""The course's models and data, for every lab that needs one.

* scikit-learn's 8x8 digits with a fixed stratified split (1440 train / 357 test) and ``DigitsCNN``: lab 02's
  DDP correctness runs, lab 03's export/quantization accuracy, lab 04-05's served classifier.
* ``ResNet`` (basic blocks: ResNet-10/18/34 and small CPU variants): lab 02's throughput scaling.
* ``BottleneckResNet`` (ResNet-50's layout, 25,557,032 parameters at width 64): lab 03's speed comparison.
* ``make_mlp``: the MLP lab 04 exports to ONNX and serves.

Weights are random unless a lab trains them; no weights or data are downloaded. The digits are read from the
file scikit-learn ships, without importing scikit-learn (seconds per spawned rank)."""

from __future__ import annotations

import functools
import importlib.util
import io
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image
from torch import nn

from lab_utils.args import check_int

# The digits split: 1797 images -> 1440 train (divisible by 1, 2, 3, 4, 5, 6, 8: no DistributedSampler
# padding for those world sizes) and 357 test (odd: sharding it over 2 ranks pads, which evaluation handles).
DIGITS_TRAIN_SIZE = 1440
DIGITS_SPLIT_SEED = 0  # fixed, so that every training seed is scored on the same test images

# Basic-block ResNet layouts (blocks per stage) by conventional depth; ResNet-50's bottleneck layout.
RESNET_BLOCKS = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}
RESNET50_BLOCKS = (3, 4, 6, 3)

MIB = 2**20


class DigitsCNN(nn.Module):
    """Input (B, 1, 8, 8) -> logits (B, 10). No BatchNorm and no dropout: a DDP step equals a one-process
    step of the same global batch (BatchNorm would see per-rank statistics, dropout per-rank masks)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.width = width
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),  # (B, w, 8, 8)
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),  # (B, 2w, 8, 8)
            nn.MaxPool2d(2),  # (B, 2w, 4, 4)
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual shortcut (1x1 conv where the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Basic-block ResNet: stages of width w, 2w, 4w, 8w. Input (B, 3, H, W) -> logits (B, classes).

    Images of 128 px and more get the ImageNet stem (7x7 stride 2 + max-pool: 224 -> 56 px); smaller ones
    a 3x3 stride-1 stem (CIFAR style), so a 32 px image still has 4 px left in the last stage."""

    def __init__(self, width: int = 64, blocks: Sequence[int] = (2, 2, 2, 2), num_classes: int = 1000,
                 image_size: int = 224):
        super().__init__()
        if image_size >= 128:
            self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        layers: list[nn.Module] = []
        c_in = width
        for stage, n in enumerate(blocks):
            c_out = width * 2**stage
            for i in range(n):
                layers.append(BasicBlock(c_in, c_out, stride=2 if (i == 0 and stage > 0) else 1))
                c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as in torchvision's v1.5), 1x1 expand x4, residual add."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1):
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class BottleneckResNet(nn.Module):
    """Input (B, 3, H, W) -> logits (B, classes). Width 64 with blocks (3, 4, 6, 3) is ResNet-50: the same
    layers and parameter count (25,557,032) as ``torchvision.models.resnet50``."""

    def __init__(self, width: int = 64, blocks: Sequence[int] = RESNET50_BLOCKS, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)  # 224 -> 112 px
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)  # 112 -> 56 px
        c_in, stages = width, []
        for i, n in enumerate(blocks):
            w = width * 2**i
            stage = []
            for j in range(n):
                stage.append(Bottleneck(c_in, w, stride=2 if (j == 0 and i > 0) else 1))
                c_in = w * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layers = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(self.layers(x)), 1))


def make_digits_cnn(width: int = 32) -> DigitsCNN:
    """The digits CNN (about 0.3 M parameters at width 32)."""
    return DigitsCNN(check_int(width, "width", "make_digits_cnn"))


def fit_digits_cnn(x: torch.Tensor, y: torch.Tensor, *, epochs: int, lr: float, seed: int, width: int,
                   batch_size: int, momentum: float = 0.9, val: tuple[torch.Tensor, torch.Tensor] | None = None,
                   on_epoch: Callable[[dict[str, float]], None] | None = None
                   ) -> tuple[DigitsCNN, list[dict[str, float]]]:
    """Train a seeded ``DigitsCNN`` on normalized images ``x`` (N, 1, 8, 8) and labels ``y``: SGD with momentum,
    cross-entropy, on the CPU with one thread (seconds). Returns the model in eval mode and, with ``val`` =
    (images, labels), one row per epoch: ``train_loss``, ``val_loss``, ``val_accuracy`` (0..1), each passed to
    ``on_epoch``; without ``val``, no rows."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 0.15 M-parameter CNN: more threads only add synchronisation (10x slower on a busy CPU)
    model = make_digits_cnn(width)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    history: list[dict[str, float]] = []
    try:
        for epoch in range(1, epochs + 1):
            model.train()
            total = 0.0
            for idx in torch.randperm(len(y), generator=gen).split(batch_size):
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
            if val is None:
                continue
            model.eval()
            with torch.no_grad():
                logits = model(val[0])
            row = {"epoch": epoch, "train_loss": total / len(y), "val_loss": float(nn.functional.cross_entropy(
                logits, val[1])), "val_accuracy": float((logits.argmax(1) == val[1]).float().mean())}
            history.append(row)
            if on_epoch is not None:
                on_epoch(row)
    finally:
        torch.set_num_threads(threads)
    return model.eval(), history


def resnet_blocks(depth: int | Sequence[int]) -> tuple[int, ...]:
    """Basic blocks per stage: depth 10, 18 or 34, or an explicit tuple such as (1, 1, 1, 1)."""
    if isinstance(depth, (int, np.integer)) and not isinstance(depth, bool):
        if int(depth) not in RESNET_BLOCKS:
            raise ValueError(f"depth={depth!r}: use one of {sorted(RESNET_BLOCKS)} or a tuple of blocks per stage")
        return RESNET_BLOCKS[int(depth)]
    blocks = tuple(depth)
    if not blocks:
        raise ValueError(f"depth={depth!r}: a tuple of blocks per stage, e.g. (2, 2, 2, 2)")
    return tuple(check_int(b, "depth", "resnet_blocks", what="blocks per stage") for b in blocks)


def make_resnet(width: int = 64, depth: int | Sequence[int] = 18, num_classes: int = 1000,
                image_size: int = 224) -> ResNet:
    """A basic-block ResNet; width 64 with depth 18 is ResNet-18 (11.7 M parameters), depth 34 ResNet-34."""
    check_int(width, "width", "make_resnet")
    check_int(num_classes, "num_classes", "make_resnet", 2)
    check_int(image_size, "image_size", "make_resnet", 8)
    return ResNet(width, resnet_blocks(depth), num_classes, image_size)


def make_mlp(in_features: int = 64, width: int = 256, depth: int = 4, out_features: int = 10,
             seed: int = 0) -> nn.Sequential:
    """An MLP of ``depth`` hidden Linear+ReLU layers of ``width``, seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    dims = [in_features] + [width] * depth
    hidden = [m for a, b in zip(dims, dims[1:], strict=False) for m in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(*hidden, nn.Linear(dims[-1], out_features)).eval()


def param_mib(model: nn.Module) -> float:
    """Size of the model's parameters in MiB; with fp32 parameters also the gradient DDP all-reduces per step."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) / MIB


def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: images (1797, 8, 8) with values 0..16 and labels (1797,).

    Read straight from the CSV that ships inside scikit-learn (what ``load_digits`` reads): importing
    sklearn costs seconds (it pulls in scipy), which every spawned rank would pay again."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz") if spec and spec.origin \
        else None
    if path and os.path.exists(path):
        data = np.loadtxt(path, delimiter=",")  # (1797, 65): 64 pixels, then the label
        return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    try:  # a scikit-learn that stores the file elsewhere
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("the digits data set comes with scikit-learn: pip install scikit-learn") from exc
    digits = load_digits()
    return digits.images, digits.target.astype(np.int64)


def _stratified_split(y: np.ndarray, n_train: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices with each class in the same proportion in both (largest-remainder quotas)."""
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(y, return_counts=True)
    exact = counts * n_train / len(y)
    quota = np.floor(exact).astype(int)
    quota[np.argsort(exact - quota)[::-1][: n_train - quota.sum()]] += 1  # hand out the rest by largest remainder
    train, test = [], []
    for c, q in zip(classes, quota, strict=True):
        idx = rng.permutation(np.flatnonzero(y == c))
        train.append(idx[:q])
        test.append(idx[q:])
    return rng.permutation(np.concatenate(train)), np.sort(np.concatenate(test))


@functools.lru_cache(maxsize=1)
def digits_arrays() -> dict[str, np.ndarray]:
    """The fixed digits split as float32/int64 arrays: x_train (1440, 1, 8, 8), y_train (1440,), x_test (357, ...).

    Stratified, seed ``DIGITS_SPLIT_SEED``. Pixels (0..16) are standardised with the training set's mean and
    standard deviation (one scalar each)."""
    raw = digits_raw_split()
    mean, std = raw["mean"], raw["std"]
    return {"x_train": (raw["x_train"][:, None] - mean) / std, "y_train": raw["y_train"],  # (1440, 1, 8, 8)
            "x_test": (raw["x_test"][:, None] - mean) / std, "y_test": raw["y_test"]}


def encode_png(image: np.ndarray, scale: int = 1, vmax: float = 16.0, smooth: bool = False) -> bytes:
    """One grey image (H, W) with values 0..``vmax`` as PNG bytes, upscaled ``scale``× (nearest neighbour, or
    bilinear with ``smooth``): what an image service or a data loader reading files receives."""
    scale = check_int(scale, "scale", "encode_png")
    pixels = np.clip(np.rint(np.asarray(image, dtype=np.float32) * (255.0 / vmax)), 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, mode="L")
    if scale != 1:
        resample = Image.Resampling.BILINEAR if smooth else Image.Resampling.NEAREST
        img = img.resize((pixels.shape[1] * scale, pixels.shape[0] * scale), resample)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def digits_raw_split() -> dict[str, np.ndarray | float]:
    """The fixed digits split (``digits_arrays``' split) as raw pixels 0..16, with the training set's mean and std
    (one scalar each, pixel units): what a model serving raw images normalizes with."""
    images, y = _digits_raw()
    train, test = _stratified_split(y, DIGITS_TRAIN_SIZE, DIGITS_SPLIT_SEED)
    x = images.astype(np.float32)
    return {"x_train": x[train], "y_train": y[train], "x_test": x[test], "y_test": y[test],
            "mean": float(x[train][:, None].mean()), "std": float(x[train][:, None].std())}


@functools.lru_cache(maxsize=4)
def digits_png(size: int = 64) -> tuple[tuple[bytes, ...], np.ndarray]:
    """All 1797 digits as PNG bytes (``size``×``size`` pixels, a multiple of 8; grayscale) and their labels."""
    if check_int(size, "size", "digits_png", minimum=8) % 8:
        raise ValueError(f"digits_png(size={size}): the 8x8 digits scale to a multiple of 8 pixels")
    images, y = _digits_raw()
    return tuple(encode_png(im, size // 8, smooth=True) for im in images), y
