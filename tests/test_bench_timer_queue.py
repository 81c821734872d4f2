"""bench/timer_queue.py on the CPU: its refusal without a GPU, and the timer put back."""
import pytest

from bench import timer_queue
from tinysn.kernels import _common


def test_without_a_gpu_it_says_so_in_one_line(capsys):
    with pytest.raises(SystemExit):
        timer_queue.main([])
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_timed_records_each_pass_and_puts_the_timer_back(monkeypatch):
    """Each run records the queue size it ran with and every timed pass's (calls, wait,
    issue); afterwards bench_ms queues and times as before."""
    seen = []

    def fake_bench_ms(fn, quantiles, warmup_ms, rep_ms):
        seen.append(_common._QUEUED_CALLS)
        _common._timed_calls(fn, [None] * 3, 0.25)
        return [0.1, 0.2, 0.3]

    monkeypatch.setattr(_common, "bench_ms", fake_bench_ms)
    monkeypatch.setattr(_common, "_timed_calls", lambda fn, events, hold_s: 0.125)
    timed_calls, queued = _common._timed_calls, _common._QUEUED_CALLS
    runs = timer_queue.timed(lambda: None, queued=1000, repeats=2)
    assert seen == [1000, 1000]
    assert runs == [{"quantiles_ms": [0.1, 0.2, 0.3], "passes": [(3, 0.25, 0.125)]}] * 2
    assert _common._timed_calls is timed_calls and _common._QUEUED_CALLS == queued
