from sgl_kvxfer.scheduler.policy import PrefillAdder, decode_reserve, pick_retraction


def test_prefill_adder_respects_token_budget_and_chunks():
    adder = PrefillAdder(token_budget=100, chunk_size=64, free_tokens=1000, max_new_reqs=8)
    a = adder.try_add(50, decode_reserve(10, 0.5))
    assert a.extend_len == 50 and not a.chunked
    b = adder.try_add(80, 0)
    assert b.extend_len == 50 and b.chunked  # token budget left: 50
    assert adder.try_add(10, 0) is None  # nothing after a chunked request


def test_prefill_adder_memory_bound():
    adder = PrefillAdder(token_budget=10_000, chunk_size=None, free_tokens=100, max_new_reqs=8)
    assert adder.try_add(90, 20) is None  # prompt + decode reserve does not fit, no chunking
    adder = PrefillAdder(token_budget=10_000, chunk_size=512, free_tokens=100, max_new_reqs=8)
    a = adder.try_add(150, 20)
    assert a.chunked and a.extend_len == 100


def test_prefill_adder_max_new_reqs():
    adder = PrefillAdder(token_budget=10_000, chunk_size=None, free_tokens=10_000, max_new_reqs=2)
    assert adder.try_add(1, 0) and adder.try_add(1, 0)
    assert adder.try_add(1, 0) is None


def test_retraction_picks_newest():
    assert pick_retraction([5, 9, 2]) == 1
