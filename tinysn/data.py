"""Training data: scikit-learn's digits (ships with the package, no download), synthetic
ImageNet-shaped batches for the zoo models, and a directory of images (torchvision's
ImageFolder, one sub-directory per class) fed through a torch DataLoader."""
from __future__ import annotations

import numpy as np
import torch


def digits(test_fraction: float = 0.2, seed: int = 0):
    """8x8 handwritten digits as float32 [N, 1, 8, 8] and int64 labels, split into
    (train_x, train_y, test_x, test_y) by a seeded shuffle and standardised with the
    training split's mean and standard deviation."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.from_numpy((bunch.images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(bunch.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    x, y = x[order], y[order]
    n_test = int(len(y) * test_fraction)
    train_x, test_x = x[n_test:], x[:n_test]
    mean, std = train_x.mean(), train_x.std()
    return (train_x - mean) / std, y[n_test:], (test_x - mean) / std, y[:n_test]


def batches(x, y, batch: int, seed: int = 0):
    """Endless shuffled full batches of (images, labels)."""
    rng = np.random.default_rng(seed)
    while True:
        order = torch.from_numpy(rng.permutation(len(y)))
        for i in range(0, len(y) - batch + 1, batch):
            idx = order[i:i + batch]
            yield x[idx].contiguous(), y[idx].contiguous()


def synthetic(net, seed: int = 0, device="cpu"):
    """One fixed random batch shaped for `net` (images ~ N(0, 1), uniform labels)."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn((net.batch, *net.input_shape), generator=gen)
    labels = torch.randint(0, net.classes, (net.batch,), generator=gen)
    return images.to(device), labels.to(device)


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def imagefolder(root, input_shape):
    """torchvision's ImageFolder at `root` with the standard evaluation transforms sized for
    `input_shape` (C, H, W): resize the short side to H * 256 / 224, center-crop (H, W),
    scale to [0, 1] and normalise with ImageNet's mean and std; for C = 1 the images are
    made grayscale first and normalised with mean 0.5, std 0.5. Deterministic, so a resumed
    run sees the same pixels."""
    try:
        from torchvision import datasets, transforms
    except ImportError:
        raise ValueError("imagefolder data needs torchvision "
                         "(pip install 'tinysn[torchvision]')") from None
    c, h, w = input_shape
    if c not in (1, 3):
        raise ValueError(f"imagefolder data gives 1 or 3 channels, the model wants {c}")
    gray = [transforms.Grayscale(1)] if c == 1 else []
    mean, std = ((0.5,), (0.5,)) if c == 1 else (IMAGENET_MEAN, IMAGENET_STD)
    steps = gray + [transforms.Resize(h * 256 // 224), transforms.CenterCrop((h, w)),
                    transforms.ToTensor(), transforms.Normalize(mean, std)]
    try:
        return datasets.ImageFolder(str(root), transforms.Compose(steps))
    except (FileNotFoundError, NotADirectoryError) as err:   # no class folders, no images
        raise ValueError(f"imagefolder {root}: {err}") from None


def loader_batches(dataset, batch: int, seed: int = 0, workers: int = 0):
    """Endless shuffled batches of (images, labels) from a torch Dataset through a
    DataLoader. Epoch e's order comes from (seed, e) alone, and each epoch's last partial
    batch is dropped (drop_last), so every step trains on exactly `batch` images and the
    stream is the same on every run (a resumed run skips the batches already taken)."""
    from torch.utils.data import DataLoader

    if len(dataset) < batch:
        raise ValueError(f"the data set has {len(dataset)} samples, fewer than one batch "
                         f"of {batch}")
    epoch = 0
    while True:
        order = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        for images, labels in DataLoader(dataset, batch_size=batch, shuffle=True,
                                         generator=order, drop_last=True,
                                         num_workers=workers):
            yield images.contiguous(), labels.to(torch.int64)
        epoch += 1
