"""bench/predict.py: which rows carry the batch-norm fusion label."""
import tinysn as sn
from bench.predict import fuses_a_batch_norm


def test_only_nets_with_a_fusible_batch_norm_are_labelled_fused():
    """VGG16 has no batch norm, so planning it with fuse_bn_relu changes nothing and its
    rows carry no label; ResNet-50's batch norms feed ReLUs."""
    assert not fuses_a_batch_norm(sn.models.vgg16(batch=2))
    assert not fuses_a_batch_norm(sn.models.alexnet(batch=2))
    assert fuses_a_batch_norm(sn.models.resnet50(batch=2))
