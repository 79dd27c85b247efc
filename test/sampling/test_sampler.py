"""The batched sampler: the draw follows the filtered softmax, seeded rows are reproducible and
independent of the rows beside them, and filtered-out tokens are never drawn."""
import math

import pytest
import torch

from sgl_kvxfer.sampling.params import SamplingParams
from sgl_kvxfer.sampling.sampler import sample

VOCAB = 6


def _params(**kw) -> SamplingParams:
    return SamplingParams.from_dict(kw)


def _frequencies(logits_row: torch.Tensor, params: SamplingParams, draws: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = logits_row.expand(draws, -1).contiguous()
    tokens = sample(rows, [params] * draws, [gen] * draws)
    return torch.bincount(torch.tensor(tokens), minlength=rows.shape[1]).double() / draws


def test_frequencies_follow_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 1.5]])
    p = _params(temperature=0.7)
    freq = _frequencies(logits, p, 20000)
    expected = torch.softmax(logits[0].double() / 0.7, -1)
    # 4 standard deviations of a binomial proportion: fails on a wrong temperature or an off-by-one
    tol = 4 * torch.sqrt(expected * (1 - expected) / 20000) + 1e-3
    assert torch.all((freq - expected).abs() < tol), (freq, expected)


@pytest.mark.parametrize("kw,allowed", [
    ({"top_k": 2}, {0, 5}),
    ({"top_p": 0.5}, {0, 5}),  # probs ~0.40, 0.24, ...: the first two reach 0.5
    ({"min_p": 0.5}, {0, 5}),  # keep p >= 0.5 * max: 0.40 and 0.24
])
def test_filters_restrict_the_support(kw, allowed):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 1.5]])
    freq = _frequencies(logits, _params(**kw), 4000)
    drawn = {i for i in range(VOCAB) if freq[i] > 0}
    assert drawn == allowed


def test_zero_mass_tokens_are_never_drawn():
    logits = torch.full((4000, VOCAB), float("-inf"))
    logits[:, 3] = 0.0
    logits[:, 1] = 0.0
    tokens = sample(logits, [_params()] * 4000, [None] * 4000)
    assert set(tokens) == {1, 3}


def test_seeded_rows_do_not_depend_on_their_neighbours():
    torch.manual_seed(0)
    row = torch.randn(1, 50)
    alone = sample(row, [_params(temperature=1.0)], [torch.Generator().manual_seed(7)])
    batch = torch.cat([torch.randn(3, 50), row, torch.randn(2, 50)])
    params = [_params(temperature=1.3), _params(top_k=1), _params(top_p=0.3), _params(temperature=1.0),
              _params(), _params(min_p=0.2)]
    gens = [None, None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(7), None, None]
    assert sample(batch, params, gens)[3] == alone[0]


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(5, 30)
    params = [_params(temperature=0), _params(), _params(temperature=0), _params(top_k=3), _params(temperature=0)]
    tokens = sample(logits, params, [None] * 5)
    for i in (0, 2, 4):
        assert tokens[i] == int(logits[i].argmax())
    assert all(0 <= t < 30 for t in tokens)
    top3 = set(torch.topk(logits[3], 3).indices.tolist())
    assert tokens[3] in top3


def test_a_seed_reproduces_its_sequence():
    logits = torch.randn(1, 1000)
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(123)
        runs.append([sample(logits, [_params()], [gen])[0] for _ in range(20)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # it does sample: 20 draws over a flat-ish 1000-way softmax


def test_large_vocabulary_keeps_its_tail():
    """A 49k-way softmax where one token holds half the mass: the other half spreads over the
    tail, and the float64 CDF draws from it at its share."""
    vocab = 49152
    logits = torch.zeros(1, vocab)
    logits[0, 0] = math.log(vocab - 1)  # p(token 0) = 0.5
    freq = _frequencies(logits, _params(), 1500, seed=3)
    assert abs(freq[0].item() - 0.5) < 4 * math.sqrt(0.25 / 1500)
