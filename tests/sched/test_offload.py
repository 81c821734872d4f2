"""sched/offload.py: the LRU cache's order and FreedRanges against a per-byte model."""
from hypothesis import given, settings, strategies as st

import tinysn as sn
from tinysn.sched import liveness
from tinysn.sched.offload import FreedRanges, Headroom, LRUCache, checkpoint_layers

SIZE = 64


def test_lru_victims_oldest_first_skipping_locked():
    c = LRUCache()
    for tid in (1, 2, 3):
        c.touch(tid)
    c.touch(1)                          # a hit moves it to the young end
    assert list(c.victims({3})) == [2, 1]
    c.remove(2)
    assert 2 not in c and len(c) == 2


def test_headroom_admits_within_the_room_and_never_over_a_blocked_step():
    """An early block is admitted when every step between its issue and its use's first
    step has the room left; a blocked step refuses every block over it, in every fresh
    copy (the planning passes of one distance), and blocking it twice changes nothing."""
    room = Headroom(free=[4096] * 6, first_step=[0, 1, 2, 3, 4, 5])
    assert room.admit(0, 3, 4096)                   # steps 1 and 2 now full
    assert not room.admit(1, 3, 1024) and room.admit(2, 5, 1024)
    fresh = room.fresh()
    assert fresh.admit(0, 3, 4096)                  # nothing admitted in a fresh copy
    assert fresh.block(4) and not fresh.block(4)
    assert not room.fresh().admit(2, 5, 1024)       # step 4 blocked for every copy
    assert room.fresh().admit(0, 4, 1024)           # spans 1..3 only


def test_lru_counts_its_members_bytes_as_they_come_and_go():
    """nbytes: each member's block bytes when it joined; a hit adds nothing, a removal (of a
    member or not) takes off what it added."""
    class Block:
        def __init__(self, nbytes):
            self.nbytes = nbytes
    blocks = {1: Block(1024), 2: Block(4096), 3: Block(2048)}
    c = LRUCache(blocks)
    for tid in (1, 2, 3, 1):
        c.touch(tid)
    assert c.nbytes == 1024 + 4096 + 2048
    c.remove(2)
    c.remove(7)
    assert c.nbytes == 1024 + 2048
    c.touch(2)
    assert c.nbytes == 1024 + 4096 + 2048


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, SIZE - 1), st.integers(1, 16),
                          st.integers(0, 9), st.integers(0, 5)), max_size=40))
def test_freed_ranges_match_a_per_byte_model(ops):
    """add() where nothing is recorded, take() anywhere: take returns exactly the largest
    position and the union of slots over the bytes it covers, and forgets those bytes only."""
    ranges, model = FreedRanges(), [None] * SIZE       # byte -> (pos, slots) or None
    for is_add, start, length, pos, slot in ops:
        end = min(start + length, SIZE)
        if is_add:
            if any(model[b] is not None for b in range(start, end)):
                continue                               # the planner never adds over a record
            slots = frozenset() if slot == 0 else frozenset({slot})
            ranges.add(start, end, pos, slots)
            if pos or slots:
                for b in range(start, end):
                    model[b] = (pos, slots)
        else:
            got_pos, got_slots = ranges.take(start, end)
            want = [model[b] for b in range(start, end) if model[b] is not None]
            assert got_pos == max((p for p, _ in want), default=0)
            assert got_slots == set().union(*(s for _, s in want))
            for b in range(start, end):
                model[b] = None
    for b in range(SIZE):                               # what is left is exactly the model's
        pos, slots = ranges.take(b, b + 1)
        assert (pos, slots) == ((0, set()) if model[b] is None else (model[b][0], set(model[b][1])))


def _checkpoint_net():
    """data -> relu -> conv -> relu -> bn -> relu -> fc -> loss: a ReLU after each kind of
    layer the checkpoint rule tells apart (data, conv, bn)."""
    net = sn.Net(input_shape=(3, 6, 6), classes=4, batch=2)
    h = net.relu(net.data(name="d"), name="r0")
    h = net.relu(net.conv(h, 4, padding=1, name="c"), name="r1")
    h = net.relu(net.bn(h, name="b"), name="r2")
    net.softmax_loss(net.fc(h, 4, name="f"), name="loss")
    return net


def test_checkpoint_layers_take_the_relu_run_in_place_after_a_checkpoint_but_the_data():
    program = liveness.Program(_checkpoint_net())
    names = lambda layers: sorted(layer.name for layer in layers)   # noqa: E731
    assert names(checkpoint_layers(program)) == ["c", "d", "r1"]
    assert names(checkpoint_layers(program, ops=("data", "bn"))) == ["b", "d", "r2"]
