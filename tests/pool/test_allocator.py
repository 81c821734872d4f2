"""BlockAllocator: a stateful property test against a bitmap model, plus plain tests."""
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from tinysn.errors import OutOfMemory
from tinysn.pool import Block, BlockAllocator


class AllocatorMachine(RuleBasedStateMachine):
    """Drive BlockAllocator and a one-byte-per-block bitmap model side by side."""

    @initialize(nblocks=st.integers(1, 16) | st.integers(4, 64), bb=st.sampled_from([1, 16, 1024]), data=st.data())
    def setup(self, nblocks, bb, data):
        extra = data.draw(st.integers(0, bb - 1), label="extra bytes (rounded away)")
        self.bb = bb
        self.nblocks = nblocks
        self.alloc_ = BlockAllocator(nblocks * bb + extra, block_bytes=bb)
        self.bitmap = bytearray(nblocks)        # 1 = used
        self.live = {}                          # id -> Block (model's view)
        self.freed = []                         # blocks freed (for double-free checks)
        self.peak = 0
        self.last_peak = 0

    # ---------------------------------------------------------------- model helpers
    def model_in_use(self):
        return sum(self.bitmap) * self.bb

    def model_first_fit(self, need):
        run = 0
        for i, used in enumerate(self.bitmap):
            run = 0 if used else run + 1
            if run == need:
                return i - need + 1
        return None

    def model_free_runs(self):
        runs, start = [], None
        for i, used in enumerate(list(self.bitmap) + [1]):
            if not used and start is None:
                start = i
            elif used and start is not None:
                runs.append((start * self.bb, (i - start) * self.bb))
                start = None
        return runs

    def model_release(self, block):
        s, n = block.offset // self.bb, block.nbytes // self.bb
        assert all(self.bitmap[s:s + n])
        self.bitmap[s:s + n] = bytes(n)
        del self.live[block.id]
        self.freed.append(block)

    def snapshot(self):
        a = self.alloc_
        return (a.free_runs(), a.in_use, a.peak, a.n_used_nodes,
                a.n_free_nodes, a.largest_free, [tuple(b) for b in a.used_blocks()])

    # ---------------------------------------------------------------- rules
    @precondition(lambda self: 0 in self.bitmap)   # a full pool must free before it allocs
    @rule(data=st.data())
    def alloc(self, data):
        # mostly small requests (so the pool fragments), sometimes anything up to too big;
        # a few per rule, so that 50 steps fill and fragment the pool
        small = st.integers(1, self.bb) | st.integers(1, 3 * self.bb)
        sizes = st.one_of(small, small, st.integers(1, (self.nblocks + 2) * self.bb))
        for nbytes in data.draw(st.lists(sizes, min_size=1, max_size=3), label="nbytes"):
            self.alloc_one(nbytes)

    def alloc_one(self, nbytes):
        need = -(-nbytes // self.bb)
        before = self.snapshot()
        start = self.model_first_fit(need)
        if start is None:
            with pytest.raises(OutOfMemory) as err:
                self.alloc_.alloc(nbytes)
            event("alloc raised OutOfMemory")
            msg = str(err.value)
            assert str(nbytes) in msg and str(self.alloc_.largest_free) in msg
            assert self.snapshot() == before, "a failed alloc changed the allocator"
            return
        block = self.alloc_.alloc(nbytes)
        assert block.offset == start * self.bb, "not first fit"
        assert block.nbytes == need * self.bb
        assert block.id not in self.live
        assert not any(self.bitmap[start:start + need])
        self.bitmap[start:start + need] = b"\x01" * need
        self.live[block.id] = block
        self.peak = max(self.peak, self.model_in_use())

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=2, unique=True),
                        label="free ids")
        for bid in ids:
            block = self.live[bid]
            self.alloc_.free(block)
            self.model_release(block)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def double_free(self, data):
        block = data.draw(st.sampled_from(self.freed), label="stale block")
        before = self.snapshot()
        with pytest.raises(ValueError, match=f"id={block.id}"):
            self.alloc_.free(block)
        assert self.snapshot() == before

    @precondition(lambda self: self.peak > self.model_in_use())
    @rule()
    def reset_peak(self):
        self.alloc_.reset_peak()
        self.peak = self.model_in_use()
        self.last_peak = self.peak

    # ---------------------------------------------------------------- invariants
    @invariant()
    def blocks_match_model_and_never_overlap(self):
        blocks = self.alloc_.used_blocks()
        assert {b.id: b for b in blocks} == self.live
        for a, b in zip(blocks, blocks[1:]):
            assert a.offset + a.nbytes <= b.offset, f"{a} overlaps {b}"
        for b in blocks:
            assert b.offset % self.bb == 0 and b.nbytes % self.bb == 0
            assert 0 <= b.offset and b.offset + b.nbytes <= self.alloc_.capacity

    @invariant()
    def byte_counts(self):
        a = self.alloc_
        assert a.capacity == self.nblocks * self.bb
        assert a.in_use == self.model_in_use()
        assert a.in_use + a.free_bytes == a.capacity
        assert a.n_used_nodes == len(self.live)

    @invariant()
    def free_runs_coalesced(self):
        runs = self.alloc_.free_runs()
        assert runs == self.model_free_runs()       # maximal runs of the bitmap
        for (o1, n1), (o2, _) in zip(runs, runs[1:]):
            assert o1 + n1 < o2, "adjacent free runs were not merged"
        assert self.alloc_.n_free_nodes == len(runs)
        assert self.alloc_.largest_free == max((n for _, n in runs), default=0)
        assert sum(n for _, n in runs) == self.alloc_.free_bytes

    @invariant()
    def peak_only_grows(self):
        a = self.alloc_
        assert a.peak == self.peak
        assert a.peak >= a.in_use and a.peak >= self.last_peak
        self.last_peak = a.peak


AllocatorMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=50,
                                              deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase


# ---------------------------------------------------------------------- plain tests
def test_rounding_and_alignment():
    a = BlockAllocator(10 * 1024 + 1000)            # capacity rounds down
    assert a.capacity == 10 * 1024 and a.block_bytes == 1024
    b1 = a.alloc(1)
    b2 = a.alloc(1024)
    b3 = a.alloc(1025)
    assert (b1.offset, b1.nbytes) == (0, 1024)
    assert (b2.offset, b2.nbytes) == (1024, 1024)
    assert (b3.offset, b3.nbytes) == (2048, 2048)
    assert a.in_use == 4096 and a.peak == 4096 and a.free_bytes == 6144
    assert all(b.offset % 1024 == 0 for b in (b1, b2, b3))
    assert BlockAllocator(1000).capacity == 0
    assert BlockAllocator("4KiB", block_bytes=512).capacity == 4096


def test_first_fit_reuses_lowest_hole_and_coalesces():
    a = BlockAllocator(8 * 1024)
    blocks = [a.alloc(1024) for _ in range(8)]
    for i in (1, 2, 5):
        a.free(blocks[i])
    assert a.free_runs() == [(1024, 2048), (5 * 1024, 1024)]
    assert a.alloc(1024).offset == 1024          # lowest hole, not the best fit
    a.free(blocks[3])
    a.free(blocks[4])                             # merges with [5]
    assert a.free_runs() == [(2048, 4096)]
    assert a.n_free_nodes == 1 and a.largest_free == 4096


def test_bad_requests():
    a = BlockAllocator(4096)
    for bad in (0, -1, 1.5, "12", None, True):
        with pytest.raises(ValueError):
            a.alloc(bad)
    assert a.in_use == 0 and a.free_runs() == [(0, 4096)]
    with pytest.raises(ValueError):
        BlockAllocator(4096, block_bytes=0)
    with pytest.raises(ValueError):
        BlockAllocator(-1)


def test_double_free_and_foreign_block():
    a, other = BlockAllocator(4096), BlockAllocator(4096)
    b = a.alloc(100)
    a.free(b)
    with pytest.raises(ValueError, match=r"Block\(id=0, offset=0, nbytes=1024\).*double free"):
        a.free(b)
    f = other.alloc(100)                          # same id/offset/size, other allocator
    with pytest.raises(ValueError, match="does not belong"):
        a.free(f)
    forged = Block(f.id, f.offset, 2048, a.alloc(100).owner)   # a's, but never allocated
    with pytest.raises(ValueError, match="not allocated"):
        a.free(forged)
    assert other.in_use == 1024 and a.in_use == 1024


def test_out_of_memory_message_and_no_change():
    a = BlockAllocator(8 * 1024)
    blocks = [a.alloc(1024) for _ in range(8)]
    for i in (0, 2, 4):
        a.free(blocks[i])                          # 3 KiB free, largest run 1 KiB
    a.reset_peak()
    before = (a.free_runs(), a.in_use, a.peak, a.n_used_nodes)
    with pytest.raises(OutOfMemory) as err:
        a.alloc(2000)
    assert isinstance(err.value, MemoryError)
    msg = str(err.value)
    assert "2000 bytes" in msg and "3072 bytes free" in msg
    assert "largest free run 1024 bytes" in msg and "capacity 8192 bytes" in msg
    assert (a.free_runs(), a.in_use, a.peak, a.n_used_nodes) == before
    assert a.alloc(1000).offset == 0               # and it still works



def test_speed_smoke():
    """The planner replays thousands of allocations: 20k of them (and 13k frees) within 2 s
    of this process's CPU time (not wall time, which a busy machine stretches)."""
    import time
    a = BlockAllocator("1GiB")
    t0 = time.process_time()
    live = []
    for i in range(20000):
        live.append(a.alloc(4096 + 1024 * (i % 37)))
        if i % 3:
            a.free(live.pop(i % len(live)))
    elapsed = time.process_time() - t0
    assert elapsed < 2.0, f"20k allocations took {elapsed:.2f} s of CPU time"


def test_small_requests_fill_from_the_top_first_fit():
    from tinysn.pool import BlockAllocator

    a = BlockAllocator(64 * 1024, 1024, small_bytes=2048)
    big = a.alloc(8 * 1024)
    small = a.alloc(100)
    assert big.offset == 0 and small.offset == 63 * 1024       # the top end
    small2 = a.alloc(2048)
    assert small2.offset == 61 * 1024
    a.free(small)
    again = a.alloc(1000)
    assert again.offset == 63 * 1024                            # highest run that fits
    big2 = a.alloc(4096)
    assert big2.offset == 8 * 1024                              # large ones: lowest fit
    assert a.in_use == (8 + 1 + 2 + 4) * 1024
    a.free(big), a.free(small2), a.free(again), a.free(big2)
    assert a.free_runs() == [(0, 64 * 1024)]
