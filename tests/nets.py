"""Small nets shared by the runtime and scheduler tests."""
import tinysn as sn


def every_layer_net(batch=2, p=0.0, classes=5):
    """Every layer type once, a fan, a concat join and a residual add, on 9x9 images."""
    net = sn.Net(input_shape=(3, 9, 9), classes=classes, batch=batch)
    x = net.data()
    h = net.relu(net.bn(net.conv(x, 6, kernel=3, padding=1, name="c1")))
    a = net.conv(h, 4, kernel=1, name="fa")                         # fan ...
    b = net.conv(h, 3, kernel=3, padding=1, bias=False, name="fb")
    h = net.concat([a, b], name="cat")                              # ... and join: 7 channels
    h = net.add(h, net.conv(x, 7, kernel=1, name="proj"), name="res")  # residual join
    h = net.pool(h, "max", kernel=3, stride=2, padding=1, name="mp")    # 5x5
    h = net.lrn(h, size=3, name="norm")
    h = net.pool(h, "avg", kernel=2, stride=1, name="ap")               # 4x4
    h = net.dropout(h, p=p, name="drop")
    h = net.relu(net.fc(h, 8, name="fc1"))
    net.softmax_loss(net.fc(h, classes, name="fc2"), name="loss")
    return net


def block_net(batch=2, p=0.3):
    """Residual conv-bn-relu blocks, max pool and dropout: the recompute policy rebuilds
    batch norms, ReLUs, the pool and the dropout here (its plan beats the one without)."""
    net = sn.Net(input_shape=(3, 8, 8), classes=4, batch=batch)
    h = net.relu(net.bn(net.conv(net.data(), 8, kernel=3, padding=1, bias=False)))
    for _ in range(2):
        y = net.relu(net.bn(net.conv(h, 8, kernel=3, padding=1, bias=False)))
        y = net.bn(net.conv(y, 8, kernel=3, padding=1, bias=False))
        h = net.relu(net.add(h, y))
    h = net.dropout(net.pool(h, "max", kernel=2, stride=2), p=p)
    net.softmax_loss(net.fc(h, 4))
    return net
