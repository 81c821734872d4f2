"""bench/conv_configs.py's choices (the GPU timing itself runs only on the device machine)."""
from bench import conv_configs
from tinysn.kernels import conv


def test_greedy_first_takes_the_best_single_config_then_what_lowers_the_total_most():
    rows = [{"ms": [2.0, 1.0, 3.0, 1.5]},      # config 1 is best alone (total 4.0)
            {"ms": [2.0, 3.0, 1.0, 1.5]}]
    assert conv_configs.greedy(rows, 1) == [3]   # 1.5 + 1.5 = 3.0 beats 1 (4.0) and 0 (4.0)
    assert conv_configs.greedy(rows, 2) == [3, 1]   # then 1: 1.0 + 1.5 (ties with 2 later)
    assert conv_configs.greedy(rows, 4) == [3, 1, 2, 0]


def test_candidates_keep_todays_configs_first_and_drop_repeats_and_oversized_tiles():
    today = conv._FWD_CONFIGS
    big = conv._cfg(256, 256, 64, 8, 4)             # 256 KiB of operand tiles per stage set
    out = conv_configs.candidates(today, [today[0], big, conv._cfg(32, 32, 32, 4, 2)])
    assert out[:len(today)] == list(today)
    assert [str(c) for c in out[len(today):]] == [str(conv._cfg(32, 32, 32, 4, 2))]
    assert not conv_configs.fits(big)
    assert all(conv_configs.fits(c) for c in conv._FWD_CONFIGS + conv._WGT_CONFIGS)
