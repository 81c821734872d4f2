"""Data: DataLoader batch streams (partial last batch dropped, seeded order) and
--data imagefolder:PATH through torchvision's ImageFolder."""
import importlib.util

import pytest
import torch
from torch.utils.data import TensorDataset

from tinysn import cli, data

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def _take(stream, count):
    return [next(stream) for _ in range(count)]


def test_loader_batches_are_full_seeded_and_cover_each_epoch_once():
    x = torch.arange(10, dtype=torch.float32).view(10, 1, 1, 1)
    dataset = TensorDataset(x, torch.arange(10) % 3)
    first = _take(data.loader_batches(dataset, 4, seed=1), 6)         # 3 epochs of 2
    assert all(images.shape == (4, 1, 1, 1) and labels.dtype == torch.int64
               for images, labels in first)
    for epoch in range(3):        # 8 distinct samples per epoch; the other 2 are dropped
        seen = torch.cat([first[2 * epoch][0], first[2 * epoch + 1][0]]).flatten()
        assert len(set(seen.tolist())) == 8
    again = _take(data.loader_batches(dataset, 4, seed=1), 6)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    other = _take(data.loader_batches(dataset, 4, seed=2), 6)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other))
    epochs = {tuple(first[2 * e][0].flatten().tolist()) for e in range(3)}
    assert len(epochs) > 1                                            # reshuffled per epoch


def test_loader_batches_need_one_full_batch():
    dataset = TensorDataset(torch.zeros(3, 1), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="3 samples, fewer than one batch of 4"):
        next(data.loader_batches(dataset, 4))


def test_cli_rejects_an_unknown_data_source(capsys):
    assert cli.main(["train", "--data", "imagefolder:"]) == 2
    assert "imagefolder:PATH" in capsys.readouterr().err


@pytest.mark.skipif(HAS_TORCHVISION, reason="checks the message shown without torchvision")
def test_imagefolder_without_torchvision_says_what_to_install(tmp_path, capsys):
    assert cli.main(["train", "--model", "lenet", "--data", f"imagefolder:{tmp_path}",
                     "--device", "cpu", "--steps", "1"]) == 2
    assert "needs torchvision" in capsys.readouterr().err


def _image_folder(root, per_class=3):
    """Two classes of small RGB PNGs: red-ish ones and blue-ish ones."""
    from PIL import Image
    for label, colour in (("blue", (10, 20, 200)), ("red", (220, 30, 10))):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (12 + i, 10), colour).save(root / label / f"{i}.png")
    return root


def test_imagefolder_gives_normalised_images_of_the_model_shape(tmp_path):
    pytest.importorskip("torchvision")
    dataset = data.imagefolder(_image_folder(tmp_path / "imgs"), (3, 8, 8))
    assert dataset.classes == ["blue", "red"] and len(dataset) == 6
    image, label = dataset[0]
    assert image.shape == (3, 8, 8) and label == 0
    want = (torch.tensor([10, 20, 200]) / 255 - torch.tensor(data.IMAGENET_MEAN)) \
        / torch.tensor(data.IMAGENET_STD)
    torch.testing.assert_close(image.mean((1, 2)), want.float(), rtol=1e-5, atol=1e-5)
    gray, _ = data.imagefolder(tmp_path / "imgs", (1, 8, 8))[0]
    assert gray.shape == (1, 8, 8)
    with pytest.raises(ValueError, match="imagefolder"):
        data.imagefolder(tmp_path / "absent", (3, 8, 8))


def test_cli_trains_on_an_image_folder(tmp_path, capsys):
    pytest.importorskip("torchvision")
    root = _image_folder(tmp_path / "imgs")
    assert cli.main(["train", "--model", "lenet", "--data", f"imagefolder:{root}",
                     "--device", "cpu", "--steps", "2", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "6 images in 2 classes" in out and "final loss" in out
