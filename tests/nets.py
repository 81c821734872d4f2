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
