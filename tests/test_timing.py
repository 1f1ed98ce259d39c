"""jax_gdn.timing: the one bench timing method (group sizing, the fixed per-group cost, the slow path), on a fake
clock so that every figure is exact."""
import pytest

from jax_gdn import timing


class FakeClock:
    """perf_counter that advances only when the fake op runs (``op_ms`` per call) or a group is synced
    (``sync_ms``, the fixed per-group cost: first dispatch + closing sync)."""

    def __init__(self, op_ms, sync_ms=0.0):
        self.t, self.op_ms, self.sync_ms, self.calls, self.syncs = 0.0, op_ms, sync_ms, 0, 0

    def perf_counter(self):
        return self.t

    def call(self):
        self.calls += 1
        self.t += self.op_ms / 1e3
        return self.calls

    def sync(self, _out):
        self.syncs += 1
        self.t += self.sync_ms / 1e3


@pytest.fixture
def clock(monkeypatch):
    def make(op_ms, sync_ms=0.0):
        c = FakeClock(op_ms, sync_ms)
        monkeypatch.setattr(timing.time, "perf_counter", c.perf_counter)
        return c
    return make


def test_group_size_clamps():
    assert timing.group_size(0.15) == 134                  # ceil(20 / 0.15)
    assert timing.group_size(5.0) == timing.MIN_PER_GROUP
    assert timing.group_size(1e-4) == timing.MAX_PER_GROUP
    assert timing.group_size(0.0) == timing.MAX_PER_GROUP


def test_sized_groups_amortise_the_fixed_cost(clock):
    # a 0.15 ms op with 0.2 ms of fixed cost per group: groups of 10 read 0.17 ms (13% high), sized groups ~0.1%
    c = clock(0.15, sync_ms=0.2)
    ten = timing.time_calls(c.call, c.sync, warmup=0, groups=3, per_group=10)
    assert ten == pytest.approx(0.17)
    c = clock(0.15, sync_ms=0.2)
    sized = timing.time_calls(c.call, c.sync, warmup=0, groups=3)
    assert sized == pytest.approx(0.15 + 0.2 / timing.group_size(0.17), rel=1e-9)
    # calls made: the probe group (MIN_PER_GROUP) + 3 sized groups; one sync each
    assert c.calls == timing.MIN_PER_GROUP + 3 * timing.group_size(0.17)
    assert c.syncs == 4


def test_warmup_and_explicit_groups_count(clock):
    c = clock(1.0)
    ms = timing.time_calls(c.call, c.sync, warmup=3, groups=5, per_group=2)
    assert ms == pytest.approx(1.0)
    assert (c.calls, c.syncs) == (3 + 10, 3 + 5)


def test_slow_path_times_single_calls(clock):
    c = clock(30.0)
    ms = timing.time_calls(c.call, c.sync, warmup=1, groups=15, slow_ms=20.0)
    assert ms == pytest.approx(30.0)
    assert c.calls == 1 + 1 + 5                            # warm-up, the slow probe, 5 single calls


def test_threaded_feeds_each_result_to_the_next(clock):
    c = clock(0.5)
    seen = []

    def step(state):
        seen.append(state)
        c.call()
        return state + 1
    timing.time_threaded(step, 0, c.sync, warmup=2, groups=2, per_group=3)
    assert seen == list(range(2 + 6))


@pytest.mark.parametrize("kw, msg", [(dict(groups=0), "groups"), (dict(per_group=0), "per_group")])
def test_bad_arguments_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        timing.time_calls(lambda: None, lambda _: None, **kw)
