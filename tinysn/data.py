"""Training data: scikit-learn's digits (ships with the package, no download) and synthetic
ImageNet-shaped batches for the zoo models."""
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
