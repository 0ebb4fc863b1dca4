"""Scheduler + BlockPool + Sequence driven by a fake model that keeps a simulated KV cache."""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from backend.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from backend.sequence import FinishReason, Sequence, SequenceStatus, StopConditions

MOD = (1 << 61) - 1
VOCAB = 1000


def kv_state(prev: int, token: int, pos: int) -> int:
    """A position's fake 'KV': depends on the token, its position and the whole prefix, like attention."""
    return (prev * 1_000_003 + token * 31 + pos + 1) % MOD


def default_sample(state: int) -> int:
    return state % VOCAB


class FakeModel:
    """Executes a SchedulerOutput against a simulated paged KV cache (slot -> state).

    Each step reads the previous position's state from the cache, so a wrong block table, a
    wrongly shared prefix block or an overwritten cached block changes the sampled tokens.
    """

    def __init__(self, sched: Scheduler, sample: Callable[[int], int] = default_sample) -> None:
        self.sched = sched
        self.sample = sample
        self.kv: dict[int, int] = {}

    def _slot(self, seq: Sequence, pos: int) -> int:
        bs = self.sched.config.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def step(self, out: SchedulerOutput) -> dict[int, int]:
        pool = self.sched.block_pool
        sampled: dict[int, int] = {}
        for entry in out.scheduled:
            seq = entry.seq
            assert entry.start == seq.num_computed_tokens and entry.num_new_tokens >= 1
            state = self.kv[self._slot(seq, entry.start - 1)] if entry.start else 0
            for pos in range(entry.start, entry.start + entry.num_new_tokens):
                block = pool.blocks[seq.block_table[pos // pool.block_size]]
                # Writing into a shared or registered block would corrupt someone else's prefix.
                assert block.ref_count == 1 and block.key is None, (seq, pos, block)
                state = kv_state(state, seq.token_ids[pos], pos)
                self.kv[self._slot(seq, pos)] = state
            assert entry.samples == (entry.start + entry.num_new_tokens == len(seq.token_ids))
            if entry.samples:
                sampled[seq.seq_id] = self.sample(state)
        return sampled


def reference(prompt: list[int], stop: StopConditions, sample: Callable[[int], int] = default_sample,
              ) -> tuple[list[int], FinishReason]:
    """What the fake model produces for one request run alone, without any cache."""
    seq = Sequence("ref", prompt, stop)
    state = 0
    for pos, tok in enumerate(prompt):
        state = kv_state(state, tok, pos)
    while True:
        seq.append_token(sample(state))
        reason = seq.check_stop()
        if reason is not None:
            return seq.output_token_ids, reason
        state = kv_state(state, seq.last_token, len(seq.token_ids) - 1)


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert out.num_batched_tokens == sum(e.num_new_tokens for e in out.scheduled)
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    assert len({e.seq.seq_id for e in out.scheduled}) == len(out.scheduled)
    ones = [e.num_new_tokens == 1 for e in out.scheduled]
    assert ones == sorted(ones, reverse=True)  # query-length-1 entries first
    assert out.scheduled or out.preempted or not sched.has_unfinished
    check_pool(sched)


def check_pool(sched: Scheduler) -> None:
    """Ref counts are exactly the running sequences' block tables; the key map is consistent."""
    pool = sched.block_pool
    refs = [0] * pool.num_total_blocks
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        for b in seq.block_table:
            refs[b] += 1
    assert refs == [b.ref_count for b in pool.blocks]
    assert pool.num_free_blocks == refs.count(0)
    assert all(pool.blocks[b].key == k for k, b in pool.cached.items())
    assert all(not s.block_table and s.status is SequenceStatus.WAITING for s in sched.waiting)


def drive(sched: Scheduler, model: FakeModel, max_steps: int = 100_000,
          on_step: Callable[[int], None] | None = None,
          mid_step: Callable[[], None] | None = None) -> list[SchedulerOutput]:
    """Run steps until nothing is left; on_step runs between steps, mid_step while the 'model' runs."""
    outs = []
    for step in range(max_steps):
        if not sched.has_unfinished:
            return outs
        out = sched.schedule()
        check_step(sched, out)
        sampled = model.step(out)
        if mid_step:
            mid_step()
        results = sched.update_from_output(out, sampled)
        assert {r.seq.seq_id for r in results} <= set(sampled)
        outs.append(out)
        if on_step:
            on_step(step)
    raise AssertionError("did not finish")


def make(num_blocks: int = 64, block_size: int = 4, **kw: int) -> tuple[Scheduler, FakeModel]:
    sched = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, **kw))
    return sched, FakeModel(sched)


def new_seq(prompt: list[int], max_new: int = 5, rid: str | None = None, **stop_kw: object) -> Sequence:
    return Sequence(rid or f"r{prompt[:3]}", prompt, StopConditions(max_new_tokens=max_new, **stop_kw))  # type: ignore[arg-type]


def assert_pool_clean(sched: Scheduler) -> None:
    pool = sched.block_pool
    assert pool.num_free_blocks == pool.num_total_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not sched.running and not sched.waiting


def test_budget_and_max_num_seqs() -> None:
    sched, model = make(max_num_seqs=3, max_num_batched_tokens=10)
    seqs = [new_seq(list(range(i, i + 7)), max_new=4, rid=str(i)) for i in range(6)]
    for s in seqs:
        sched.add(s)
    outs = drive(sched, model)
    assert max(len(o.scheduled) for o in outs) == 3
    assert max(o.num_batched_tokens for o in outs) == 10
    for s in seqs:
        assert (s.output_token_ids, s.finish_reason) == reference(s.prompt_token_ids, s.stop)
        assert s.first_scheduled_time is not None and s.first_token_time is not None
    assert_pool_clean(sched)


def test_chunked_prefill_mixes_with_decodes() -> None:
    sched, model = make(max_num_batched_tokens=16)
    short = new_seq([1, 2, 3], max_new=30, rid="short")
    sched.add(short)
    out = sched.schedule()  # short's prefill, samples its first token
    sched.update_from_output(out, model.step(out))
    long = new_seq(list(range(100, 150)), max_new=2, rid="long")
    sched.add(long)
    starts = []
    for _ in range(4):
        out = sched.schedule()
        check_step(sched, out)
        assert [e.seq.request_id for e in out.scheduled] == ["short", "long"]
        assert out.scheduled[0].num_new_tokens == 1 and out.scheduled[0].samples
        starts.append((out.scheduled[1].start, out.scheduled[1].num_new_tokens, out.scheduled[1].samples))
        sched.update_from_output(out, model.step(out))
    assert starts == [(0, 15, False), (15, 15, False), (30, 15, False), (45, 5, True)]
    assert sched.stats().queued_prefill_tokens == 0
    drive(sched, model)
    for s in (short, long):
        assert (s.output_token_ids, s.finish_reason) == reference(s.prompt_token_ids, s.stop)


def test_long_prefill_threshold_shares_a_step() -> None:
    sched, model = make(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    a, b = new_seq(list(range(20)), rid="a"), new_seq(list(range(50, 70)), rid="b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 8), ("b", 8)]


def test_preemption_latest_admitted_first_and_same_output() -> None:
    # 8 blocks of 4 = 32 slots; three 8-token prompts (2 blocks each) growing by 12 tokens each.
    sched, model = make(num_blocks=8, max_num_batched_tokens=64)
    seqs = [new_seq(list(range(10 * i, 10 * i + 8)), max_new=12, rid=f"s{i}") for i in range(3)]
    for s in seqs:
        sched.add(s)
    outs = drive(sched, model)  # check_pool: preempted sequences wait with no blocks
    preempted = [s.request_id for o in outs for s in o.preempted]
    assert preempted and preempted[0] == "s2"  # the latest admitted goes first
    assert all(s.num_preemptions > 0 for s in seqs if s.request_id in preempted)
    for s in seqs:
        assert (s.output_token_ids, s.finish_reason) == reference(s.prompt_token_ids, s.stop)
    assert_pool_clean(sched)


def test_preempted_goes_to_front_of_waiting() -> None:
    sched, model = make(num_blocks=4, max_num_batched_tokens=64, max_num_seqs=2)
    a, b, c = new_seq([1, 2, 3, 4], max_new=9, rid="a"), new_seq([5, 6, 7, 8], max_new=9, rid="b"), new_seq([9], rid="c")
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    while not out.preempted:
        sched.update_from_output(out, model.step(out))
        out = sched.schedule()
    assert out.preempted == [b]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert [e.seq.request_id for e in out.scheduled] == ["a"]
    sched.update_from_output(out, model.step(out))
    drive(sched, model)
    for s in (a, b, c):
        assert (s.output_token_ids, s.finish_reason) == reference(s.prompt_token_ids, s.stop)


def test_prefix_hit_skips_cached_tokens() -> None:
    sched, model = make(max_num_batched_tokens=64)
    prefix = list(range(500, 512))  # 3 full blocks
    a = new_seq(prefix + [1, 2], rid="a")
    sched.add(a)
    drive(sched, model)
    b = new_seq(prefix + [7, 8, 9], rid="b")
    sched.add(b)
    out = sched.schedule()
    (entry,) = out.scheduled
    assert b.num_cached_tokens == 12 and entry.start == 12 and entry.num_new_tokens == 3
    sched.update_from_output(out, model.step(out))
    drive(sched, model)
    assert (b.output_token_ids, b.finish_reason) == reference(b.prompt_token_ids, b.stop)
    assert_pool_clean(sched)


def test_stop_conditions() -> None:
    def run(max_new: int = 10, prompt: tuple[int, ...] = (1,), **kw: object) -> tuple[list[int], FinishReason | None]:
        seq = new_seq(list(prompt), max_new=max_new, **kw)
        for tok in [5, 7, 8, 9, 7, 3, 4, 5, 6, 2, 2, 2]:
            seq.append_token(tok)
            if (reason := seq.check_stop()) is not None:
                return seq.output_token_ids, reason
        return seq.output_token_ids, None

    assert run() == ([5, 7, 8, 9, 7, 3, 4, 5, 6, 2], FinishReason.LENGTH)
    assert run(eos_token_ids=frozenset({7})) == ([5, 7], FinishReason.STOP)
    assert run(eos_token_ids=frozenset({7}), min_new_tokens=3) == ([5, 7, 8, 9, 7], FinishReason.STOP)
    assert run(eos_token_ids=frozenset({7}), ignore_eos=True) == ([5, 7, 8, 9, 7, 3, 4, 5, 6, 2], FinishReason.LENGTH)
    assert run(stop_token_ids=frozenset({9}), ignore_eos=True) == ([5, 7, 8, 9], FinishReason.STOP)
    assert run(stop_sequences=((8, 9, 7),)) == ([5, 7, 8, 9, 7], FinishReason.STOP)
    # Only generated ids count: the prompt ending in 1 does not make (1, 5) match.
    assert run(stop_sequences=((1, 5), (4, 5))) == ([5, 7, 8, 9, 7, 3, 4, 5], FinishReason.STOP)
    assert run(max_new=3) == ([5, 7, 8], FinishReason.LENGTH)
    assert run(prompt=(1, 1, 1), max_total_len=6) == ([5, 7, 8], FinishReason.LENGTH)
    assert run(max_new=2, eos_token_ids=frozenset({7})) == ([5, 7], FinishReason.STOP)  # STOP wins a tie
    with pytest.raises(ValueError):
        StopConditions(max_new_tokens=0)
    with pytest.raises(ValueError):
        StopConditions(max_new_tokens=3, stop_sequences=((),))


def test_eos_through_scheduler_frees_blocks() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    model = FakeModel(sched, sample=lambda _state: 7)
    seq = new_seq([1, 2, 3], max_new=50, eos_token_ids=frozenset({7}), min_new_tokens=3)
    sched.add(seq)
    drive(sched, model)
    assert seq.output_token_ids == [7, 7, 7] and seq.finish_reason is FinishReason.STOP
    assert_pool_clean(sched)


def test_abort_frees_blocks() -> None:
    sched, model = make(num_blocks=16, max_num_seqs=1)
    running, waiting = new_seq(list(range(9)), rid="x"), new_seq([1, 2], rid="y")
    sched.add(running)
    sched.add(waiting)
    out = sched.schedule()
    assert sched.block_pool.num_free_blocks < 16
    sampled = model.step(out)
    assert sched.abort("x") == [running]  # arrives while the step runs: after schedule(), before update
    assert running.status is SequenceStatus.FINISHED and running.finish_reason is FinishReason.ABORT
    assert sched.update_from_output(out, sampled) == []
    assert running.num_output_tokens == 0
    assert sched.abort("y") == [waiting] and sched.abort("nope") == []
    assert_pool_clean(sched)


def test_fits_ever_and_pool_capacity_length() -> None:
    sched, model = make(num_blocks=4, block_size=4)
    assert sched.fits_ever(16) and not sched.fits_ever(17)
    with pytest.raises(ValueError):
        sched.add(new_seq(list(range(17))))
    seq = new_seq(list(range(10)), max_new=100)
    sched.add(seq)
    drive(sched, model)
    # 16 slots: 6 outputs fill them, the 7th is sampled from the last slot but has no room for its KV.
    assert seq.num_output_tokens == 7 and seq.finish_reason is FinishReason.LENGTH
    assert_pool_clean(sched)


def test_stats_and_version() -> None:
    sched, model = make(max_num_batched_tokens=8)
    v0 = sched.stats().version
    sched.add(new_seq(list(range(20)), rid="a"))
    st = sched.stats()
    assert (st.num_waiting, st.num_running, st.queued_prefill_tokens, st.total_blocks) == (1, 0, 20, 64)
    assert st.version > v0
    out = sched.schedule()
    sched.update_from_output(out, model.step(out))
    st = sched.stats()
    assert (st.num_waiting, st.num_running, st.queued_prefill_tokens, st.free_blocks) == (0, 1, 12, 64 - 5)


@pytest.mark.parametrize("seed", range(10))
def test_fuzz_random_requests_complete_with_reference_output(seed: int) -> None:
    rng = random.Random(seed)
    sched, model = make(num_blocks=24, block_size=4, max_num_seqs=rng.choice([4, 8, 16]),
                        max_num_batched_tokens=rng.choice([8, 16, 48]))
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 24))] for _ in range(6)]
    pending: list[Sequence] = []
    for i in range(200):
        if pending and rng.random() < 0.15:  # an exact repeat: the hit must still leave a token to compute
            prompt = rng.choice(pending).prompt_token_ids
        else:
            prompt = rng.choice(prefixes)[: rng.randrange(0, 24)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 16))]
        stop = StopConditions(max_new_tokens=rng.randrange(1, 30),
                              eos_token_ids=frozenset({rng.randrange(VOCAB)}) if rng.random() < 0.3 else frozenset())
        pending.append(Sequence(f"req{i}", prompt, stop))
    all_seqs = list(pending)
    aborted: set[str] = set()

    def maybe_abort() -> None:
        if rng.random() < 0.03:
            victim = rng.choice(all_seqs).request_id
            if sched.abort(victim):
                aborted.add(victim)

    pool = sched.block_pool
    mirror: set[int] = set()  # what a router following cache_diff believes is cached
    mirror_version = 0

    def step(_: int) -> None:
        nonlocal mirror_version
        for _ in range(rng.choice([0, 0, 1, 3])):  # arrivals between steps
            if pending:
                sched.add(pending.pop(0))
        maybe_abort()
        diff = pool.cache_diff(mirror_version)
        assert diff is not None
        mirror_version, added, removed = diff
        mirror.update(added)
        mirror.difference_update(removed)
        assert mirror == set(pool.cached_keys())

    outs: list[SchedulerOutput] = []
    while pending:  # the queue may drain before every request arrived
        step(0)
        outs += drive(sched, model, on_step=step, mid_step=maybe_abort)
    assert any(o.preempted for o in outs), "pool too large to exercise preemption"
    assert any(s.num_cached_tokens for s in all_seqs), "no prefix hit exercised"
    for s in all_seqs:
        assert s.status is SequenceStatus.FINISHED
        if s.request_id in aborted:
            assert s.finish_reason is FinishReason.ABORT
            continue
        assert (s.output_token_ids, s.finish_reason) == reference(s.prompt_token_ids, s.stop), s
    assert_pool_clean(sched)
