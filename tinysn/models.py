"""The model zoo: each builder returns a Net, f(batch=..., classes=..., input_shape=...).

Layer names follow torchvision where there is one (dots become underscores: torchvision's
"layer1.0.conv1" is "layer1_0_conv1" here), so parameters map one to one. Every builder
builds at small inputs too; the smallest input each accepts is in its docstring.

Parameter counts at ImageNet size, classes=1000 (checked in tests/test_models.py):
  resnet50 25,557,032   resnet101 44,549,160   resnet152 60,192,808   (torchvision)
  vgg16 138,357,544     densenet121 7,978,856                          (torchvision)
  alexnet 62,378,344    (Caffe's layout without the two-GPU groups)
  inception_v4 42,679,816 (Szegedy et al. 2016, as in timm)
"""
from __future__ import annotations

from .graph import Net


def _global_avgpool(net, x, name):
    """Average over the whole remaining H x W (torch's adaptive_avg_pool2d to 1x1)."""
    return net.pool(x, "avg", kernel=x.shape[2:], stride=1, name=name)


# ------------------------------------------------------------------------------ LeNet
def lenet(batch=32, classes=10, input_shape=(1, 8, 8)) -> Net:
    """A small LeNet for scikit-learn's 8x8 digits: [conv3x3(16) pad1, relu, maxpool2,
    conv3x3(32) pad1, relu, maxpool2], fc 64, relu, fc classes, loss. Input >= 4x4."""
    net = Net(input_shape, classes, batch)
    x = net.data()
    x = net.pool(net.relu(net.conv(x, 16, 3, padding=1, name="conv1")), "max", 2, name="pool1")
    x = net.pool(net.relu(net.conv(x, 32, 3, padding=1, name="conv2")), "max", 2, name="pool2")
    x = net.relu(net.fc(x, 64, name="fc1"))
    net.softmax_loss(net.fc(x, classes, name="fc2"), name="loss")
    return net


# ----------------------------------------------------------------------------- AlexNet
def alexnet(batch=32, classes=1000, input_shape=(3, 227, 227)) -> Net:
    """Caffe's AlexNet (bvlc_alexnet) without its two-GPU conv groups: conv11x11/4(96), relu,
    lrn, maxpool3/2, conv5x5(256) pad2, relu, lrn, maxpool3/2, conv3x3(384) pad1, relu,
    conv3x3(384), relu, conv3x3(256), relu, maxpool3/2, [fc4096, relu, dropout] x2, fc classes.
    LRN: size 5, alpha 1e-4, beta 0.75, k 2 (the AlexNet paper's constants).
    Input >= 67x67 (the spatial size shrinks to 1x1 before fc6)."""
    net = Net(input_shape, classes, batch)
    x = net.data()
    x = net.relu(net.conv(x, 96, 11, stride=4, name="conv1"), name="relu1")
    x = net.lrn(x, 5, 1e-4, 0.75, 2.0, name="norm1")
    x = net.pool(x, "max", 3, 2, name="pool1")
    x = net.relu(net.conv(x, 256, 5, padding=2, name="conv2"), name="relu2")
    x = net.lrn(x, 5, 1e-4, 0.75, 2.0, name="norm2")
    x = net.pool(x, "max", 3, 2, name="pool2")
    x = net.relu(net.conv(x, 384, 3, padding=1, name="conv3"), name="relu3")
    x = net.relu(net.conv(x, 384, 3, padding=1, name="conv4"), name="relu4")
    x = net.relu(net.conv(x, 256, 3, padding=1, name="conv5"), name="relu5")
    x = net.pool(x, "max", 3, 2, name="pool5")
    x = net.dropout(net.relu(net.fc(x, 4096, name="fc6"), name="relu6"), 0.5, name="drop6")
    x = net.dropout(net.relu(net.fc(x, 4096, name="fc7"), name="relu7"), 0.5, name="drop7")
    net.softmax_loss(net.fc(x, classes, name="fc8"), name="loss")
    return net


# -------------------------------------------------------------------------------- VGG
def vgg16(batch=32, classes=1000, input_shape=(3, 224, 224)) -> Net:
    """VGG-16 (configuration D, no batch norm) as torchvision: 13 conv3x3 pad1 + relu in 5
    stages closed by maxpool2, then fc4096, relu, dropout, fc4096, relu, dropout, fc.
    At 224x224 the last feature map is 7x7 as torchvision's adaptive pool expects; at other
    sizes fc1 takes whatever the features flatten to. Input >= 32x32."""
    net = Net(input_shape, classes, batch)
    x = net.data()
    for stage, (width, depth) in enumerate([(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)], 1):
        for i in range(1, depth + 1):
            x = net.relu(net.conv(x, width, 3, padding=1, name=f"conv{stage}_{i}"),
                         name=f"relu{stage}_{i}")
        x = net.pool(x, "max", 2, name=f"pool{stage}")
    x = net.dropout(net.relu(net.fc(x, 4096, name="fc6"), name="relu6"), 0.5, name="drop6")
    x = net.dropout(net.relu(net.fc(x, 4096, name="fc7"), name="relu7"), 0.5, name="drop7")
    net.softmax_loss(net.fc(x, classes, name="fc8"), name="loss")
    return net


# ----------------------------------------------------------------------------- ResNet
def _conv_bn(net, x, c, kernel, stride, padding, prefix, i, relu=True):
    x = net.conv(x, c, kernel, stride, padding, bias=False, name=f"{prefix}conv{i}")
    x = net.bn(x, name=f"{prefix}bn{i}")
    return net.relu(x, name=f"{prefix}relu{i}") if relu else x


def _basic_block(net, x, width, stride, prefix):
    out = _conv_bn(net, x, width, 3, stride, 1, prefix, 1)
    out = _conv_bn(net, out, width, 3, 1, 1, prefix, 2, relu=False)
    return out, width


def _bottleneck(net, x, width, stride, prefix):
    out = _conv_bn(net, x, width, 1, 1, 0, prefix, 1)
    out = _conv_bn(net, out, width, 3, stride, 1, prefix, 2)       # v1.5: stride here
    out = _conv_bn(net, out, 4 * width, 1, 1, 0, prefix, 3, relu=False)
    return out, 4 * width


def resnet(blocks=(3, 4, 6, 3), bottleneck=True, batch=32, classes=1000,
           input_shape=(3, 224, 224)) -> Net:
    """ResNet as torchvision's (v1.5: the stride sits on the 3x3 conv of a bottleneck).

    Stem conv7x7/2(64) bias-free, bn, relu, maxpool3/2 pad1; four stages of `blocks[i]`
    blocks of width 64, 128, 256, 512 (stride 2 from the second stage on); bottleneck blocks
    1x1, 3x3, 1x1(4x width), basic blocks 3x3, 3x3; a projection shortcut (conv1x1 with
    the block's stride + bn) wherever the shape changes; add, relu; global average pool, fc.
    Any number of stages >= 1 and any depth. Input >= 1x1 (any size works).
    """
    blocks = list(blocks)
    if not blocks or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks):
        raise ValueError(f"blocks must be a non-empty list of positive ints, got {blocks!r}")
    block = _bottleneck if bottleneck else _basic_block
    net = Net(input_shape, classes, batch)
    x = net.data()
    x = _conv_bn(net, x, 64, 7, 2, 3, "", 1)
    x = net.pool(x, "max", 3, 2, 1, name="maxpool")
    channels = 64
    for stage, n in enumerate(blocks):
        width = 64 * 2 ** stage
        for b in range(n):
            prefix = f"layer{stage + 1}_{b}_"
            stride = 2 if stage > 0 and b == 0 else 1
            out, out_channels = block(net, x, width, stride, prefix)
            if stride != 1 or channels != out_channels:
                x = net.conv(x, out_channels, 1, stride, bias=False, name=f"{prefix}downsample_0")
                x = net.bn(x, name=f"{prefix}downsample_1")
            x = net.relu(net.add(out, x, name=f"{prefix}add"), name=f"{prefix}relu")
            channels = out_channels
    x = _global_avgpool(net, x, "avgpool")
    net.softmax_loss(net.fc(x, classes, name="fc"), name="loss")
    return net


def resnet18(batch=32, classes=1000, input_shape=(3, 224, 224)) -> Net:
    """torchvision resnet18 (basic blocks [2, 2, 2, 2]), 11,689,512 parameters."""
    return resnet([2, 2, 2, 2], False, batch, classes, input_shape)


def resnet34(batch=32, classes=1000, input_shape=(3, 224, 224)) -> Net:
    """torchvision resnet34 (basic blocks [3, 4, 6, 3]), 21,797,672 parameters."""
    return resnet([3, 4, 6, 3], False, batch, classes, input_shape)


def resnet50(batch=32, classes=1000, input_shape=(3, 224, 224)) -> Net:
    """torchvision resnet50 (bottlenecks [3, 4, 6, 3]), 25,557,032 parameters."""
    return resnet([3, 4, 6, 3], True, batch, classes, input_shape)


def resnet101(batch=32, classes=1000, input_shape=(3, 224, 224)) -> Net:
    """torchvision resnet101 (bottlenecks [3, 4, 23, 3]), 44,549,160 parameters."""
    return resnet([3, 4, 23, 3], True, batch, classes, input_shape)


def resnet152(batch=32, classes=1000, input_shape=(3, 224, 224)) -> Net:
    """torchvision resnet152 (bottlenecks [3, 8, 36, 3]), 60,192,808 parameters."""
    return resnet([3, 8, 36, 3], True, batch, classes, input_shape)


# ------------------------------------------------------------------------ Inception v4
def inception_v4(batch=32, classes=1000, input_shape=(3, 299, 299), dropout=0.2) -> Net:
    """Inception-v4 (Szegedy et al. 2016, Figs. 3-9), the layout of timm / Cadene's port.

    Stem, 4 x Inception-A, Reduction-A, 7 x Inception-B, Reduction-B, 3 x Inception-C,
    global average pool, dropout (keep 0.8), fc 1536 -> classes. Every conv is
    conv(bias=False) + bn + relu ("BasicConv2d"); branches join by concat. Differences from
    timm: bn eps 1e-5 (timm 1e-3), and the branch average pools count the zero padding
    (torch's default; timm uses count_include_pad=False). Neither changes the parameter
    count, 42,679,816 at classes=1000. Input >= 75x75.
    """
    net = Net(input_shape, classes, batch)

    def conv(x, c, kernel, stride=1, padding=0, name=""):
        x = net.conv(x, c, kernel, stride, padding, bias=False, name=f"{name}_conv")
        x = net.bn(x, name=f"{name}_bn")
        return net.relu(x, name=f"{name}_relu")

    def avg3(x, name):
        return net.pool(x, "avg", 3, 1, 1, name=name)

    x = net.data()
    # stem (Fig. 3)
    x = conv(x, 32, 3, 2, name="stem_1")                      # 149
    x = conv(x, 32, 3, name="stem_2")                          # 147
    x = conv(x, 64, 3, 1, 1, name="stem_3")                    # 147
    x = net.concat([net.pool(x, "max", 3, 2, name="mixed3a_pool"),
                    conv(x, 96, 3, 2, name="mixed3a_b1")], name="mixed3a")  # 73, 160
    b0 = conv(conv(x, 64, 1, name="mixed4a_b0_1"), 96, 3, name="mixed4a_b0_2")
    b1 = conv(x, 64, 1, name="mixed4a_b1_1")
    b1 = conv(b1, 64, (1, 7), padding=(0, 3), name="mixed4a_b1_2")
    b1 = conv(b1, 64, (7, 1), padding=(3, 0), name="mixed4a_b1_3")
    b1 = conv(b1, 96, 3, name="mixed4a_b1_4")
    x = net.concat([b0, b1], name="mixed4a")                  # 71, 192
    x = net.concat([conv(x, 192, 3, 2, name="mixed5a_b0"),
                    net.pool(x, "max", 3, 2, name="mixed5a_pool")], name="mixed5a")  # 35, 384

    for i in range(4):                                         # Inception-A (Fig. 4)
        p = f"a{i + 1}"
        b0 = conv(x, 96, 1, name=f"{p}_b0")
        b1 = conv(conv(x, 64, 1, name=f"{p}_b1_1"), 96, 3, padding=1, name=f"{p}_b1_2")
        b2 = conv(x, 64, 1, name=f"{p}_b2_1")
        b2 = conv(b2, 96, 3, padding=1, name=f"{p}_b2_2")
        b2 = conv(b2, 96, 3, padding=1, name=f"{p}_b2_3")
        b3 = conv(avg3(x, f"{p}_b3_pool"), 96, 1, name=f"{p}_b3")
        x = net.concat([b0, b1, b2, b3], name=f"{p}_concat")   # 384

    # Reduction-A (Fig. 7; k, l, m, n = 192, 224, 256, 384)
    b0 = conv(x, 384, 3, 2, name="ra_b0")
    b1 = conv(x, 192, 1, name="ra_b1_1")
    b1 = conv(b1, 224, 3, padding=1, name="ra_b1_2")
    b1 = conv(b1, 256, 3, 2, name="ra_b1_3")
    b2 = net.pool(x, "max", 3, 2, name="ra_pool")
    x = net.concat([b0, b1, b2], name="ra_concat")            # 17, 1024

    for i in range(7):                                         # Inception-B (Fig. 5)
        p = f"b{i + 1}"
        b0 = conv(x, 384, 1, name=f"{p}_b0")
        b1 = conv(x, 192, 1, name=f"{p}_b1_1")
        b1 = conv(b1, 224, (1, 7), padding=(0, 3), name=f"{p}_b1_2")
        b1 = conv(b1, 256, (7, 1), padding=(3, 0), name=f"{p}_b1_3")
        b2 = conv(x, 192, 1, name=f"{p}_b2_1")
        b2 = conv(b2, 192, (7, 1), padding=(3, 0), name=f"{p}_b2_2")
        b2 = conv(b2, 224, (1, 7), padding=(0, 3), name=f"{p}_b2_3")
        b2 = conv(b2, 224, (7, 1), padding=(3, 0), name=f"{p}_b2_4")
        b2 = conv(b2, 256, (1, 7), padding=(0, 3), name=f"{p}_b2_5")
        b3 = conv(avg3(x, f"{p}_b3_pool"), 128, 1, name=f"{p}_b3")
        x = net.concat([b0, b1, b2, b3], name=f"{p}_concat")   # 1024

    # Reduction-B (Fig. 8)
    b0 = conv(conv(x, 192, 1, name="rb_b0_1"), 192, 3, 2, name="rb_b0_2")
    b1 = conv(x, 256, 1, name="rb_b1_1")
    b1 = conv(b1, 256, (1, 7), padding=(0, 3), name="rb_b1_2")
    b1 = conv(b1, 320, (7, 1), padding=(3, 0), name="rb_b1_3")
    b1 = conv(b1, 320, 3, 2, name="rb_b1_4")
    b2 = net.pool(x, "max", 3, 2, name="rb_pool")
    x = net.concat([b0, b1, b2], name="rb_concat")            # 8, 1536

    for i in range(3):                                         # Inception-C (Fig. 6)
        p = f"c{i + 1}"
        b0 = conv(x, 256, 1, name=f"{p}_b0")
        b1 = conv(x, 384, 1, name=f"{p}_b1_1")                 # fans into 1x3 and 3x1
        b1a = conv(b1, 256, (1, 3), padding=(0, 1), name=f"{p}_b1_2a")
        b1b = conv(b1, 256, (3, 1), padding=(1, 0), name=f"{p}_b1_2b")
        b2 = conv(x, 384, 1, name=f"{p}_b2_1")
        b2 = conv(b2, 448, (3, 1), padding=(1, 0), name=f"{p}_b2_2")
        b2 = conv(b2, 512, (1, 3), padding=(0, 1), name=f"{p}_b2_3")
        b2a = conv(b2, 256, (1, 3), padding=(0, 1), name=f"{p}_b2_4a")
        b2b = conv(b2, 256, (3, 1), padding=(1, 0), name=f"{p}_b2_4b")
        b3 = conv(avg3(x, f"{p}_b3_pool"), 256, 1, name=f"{p}_b3")
        x = net.concat([b0, b1a, b1b, b2a, b2b, b3], name=f"{p}_concat")   # 1536

    x = _global_avgpool(net, x, "avgpool")
    if dropout:
        x = net.dropout(x, dropout, name="dropout")
    net.softmax_loss(net.fc(x, classes, name="fc"), name="loss")
    return net


# ---------------------------------------------------------------------------- DenseNet
def densenet(blocks=(6, 12, 24, 16), growth=32, init_features=64, bn_size=4, batch=32,
             classes=1000, input_shape=(3, 224, 224)) -> Net:
    """DenseNet-BC as torchvision's: stem conv7x7/2 bias-free, bn, relu, maxpool3/2 pad1;
    dense blocks whose layers are bn-relu-conv1x1(bn_size*growth)-bn-relu-conv3x3(growth)
    and join by concatenating every earlier feature map of the block (a full join);
    transitions bn-relu-conv1x1(half)-avgpool2/2 between blocks; final bn, relu, global
    average pool, fc. Input >= 29x29 with 4 blocks (three transitions halve the size)."""
    blocks = list(blocks)
    net = Net(input_shape, classes, batch)
    x = net.data()
    x = net.conv(x, init_features, 7, 2, 3, bias=False, name="conv0")
    x = net.relu(net.bn(x, name="norm0"), name="relu0")
    x = net.pool(x, "max", 3, 2, 1, name="pool0")
    channels = init_features
    for bi, n in enumerate(blocks, 1):
        features = [x]               # the block's input and every new layer's output
        for li in range(1, n + 1):
            p = f"denseblock{bi}_denselayer{li}_"
            # full join: a layer reads the concatenation of every earlier feature map of its
            # block (torchvision's torch.cat(features, 1)); the first reads the input alone
            h = features[0] if li == 1 else net.concat(features, name=f"{p}concat")
            h = net.relu(net.bn(h, name=f"{p}norm1"), name=f"{p}relu1")
            h = net.conv(h, bn_size * growth, 1, bias=False, name=f"{p}conv1")
            h = net.relu(net.bn(h, name=f"{p}norm2"), name=f"{p}relu2")
            h = net.conv(h, growth, 3, padding=1, bias=False, name=f"{p}conv2")
            features.append(h)
            channels += growth
        x = net.concat(features, name=f"denseblock{bi}_concat")
        if bi != len(blocks):
            p = f"transition{bi}_"
            x = net.relu(net.bn(x, name=f"{p}norm"), name=f"{p}relu")
            channels //= 2
            x = net.conv(x, channels, 1, bias=False, name=f"{p}conv")
            x = net.pool(x, "avg", 2, 2, name=f"{p}pool")
    x = net.relu(net.bn(x, name="norm5"), name="relu5")
    x = _global_avgpool(net, x, "avgpool")
    net.softmax_loss(net.fc(x, classes, name="classifier"), name="loss")
    return net


def densenet121(batch=32, classes=1000, input_shape=(3, 224, 224)) -> Net:
    """torchvision densenet121 (growth 32, blocks [6, 12, 24, 16]), 7,978,856 parameters."""
    return densenet((6, 12, 24, 16), 32, 64, 4, batch, classes, input_shape)


__all__ = ["lenet", "alexnet", "vgg16", "resnet", "resnet18", "resnet34", "resnet50",
           "resnet101", "resnet152", "inception_v4", "densenet", "densenet121"]
