"""Canary exposure: known rankings, the skew-normal approximation, canaries and bad input.

References are independent of the implementation: closed-form ranks of
hand-built scorers (a bijective "digit" scorer, a Hamming scorer with ties, a
bigram model), quantiles of a known skew-normal, and mpmath quadrature.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import mpmath
import numpy as np
import pytest
from scipy import stats

from dptrain.audit import (
    DEFAULT_PREFIX_FORMAT,
    candidate_words,
    check_encodable,
    exposure_by_distribution,
    exposure_by_rank,
    fit_skewnorm,
    insert_canaries,
    make_canaries,
    skewnorm_logcdf,
)
from dptrain.data.tokenizer import train_tokenizer

WORDS = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
    "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa",
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    """A small BPE tokenizer that knows the canary format and WORDS, but no digits or '€'."""
    texts = [DEFAULT_PREFIX_FORMAT.replace("{word}", w) + " " + " ".join(WORDS) for w in WORDS]
    return train_tokenizer(texts * 5, kind="bpe", vocab_size=200)


# -- exposure by rank: scorers whose ranking is known in closed form --------------------------


def test_exposure_by_rank_digit_scorer_is_exact():
    """log_ppl(s) = sum_i V^i ((s_i - c_i) mod V) is a bijection onto 0..V^l-1: rank = value + 1."""
    v, length = 4, 3
    canary = (2, 0, 3)
    secrets = list(itertools.product(range(v), repeat=length))

    def score(s):
        return float(
            sum(v**i * ((si - ci) % v) for i, (si, ci) in enumerate(zip(s, canary, strict=True)))
        )

    scores = {s: score(s) for s in secrets}
    assert sorted(scores.values()) == [float(k) for k in range(v**length)]
    for s in secrets[::5]:
        others = [scores[t] for t in secrets if t != s]
        expected = math.log2(v**length) - math.log2(scores[s] + 1)
        assert exposure_by_rank(scores[s], others) == pytest.approx(expected, abs=1e-12)
    # the canary itself (score 0) is the first guess: exposure = log2 |R| = l log2 V = 6 bits
    others = [scores[t] for t in secrets if t != canary]
    assert exposure_by_rank(0.0, others) == pytest.approx(6.0)
    assert exposure_by_rank(0.0, others, space_size=v**length) == pytest.approx(6.0)


def test_exposure_by_rank_ties_count_half():
    """Hamming distance to the canary: many ties; rank = 1 + #closer + (#same distance - 1) / 2."""
    v, length = 3, 4
    canary = (0, 1, 2, 0)
    secrets = list(itertools.product(range(v), repeat=length))
    dist = {s: sum(a != b for a, b in zip(s, canary, strict=True)) for s in secrets}
    size = v**length
    for d in range(length + 1):
        closer = sum(math.comb(length, j) * (v - 1) ** j for j in range(d))
        same = math.comb(length, d) * (v - 1) ** d
        rank = 1 + closer + (same - 1) / 2
        s = next(t for t in secrets if dist[t] == d)
        others = [float(dist[t]) for t in secrets if t != s]
        assert exposure_by_rank(float(d), others) == pytest.approx(
            math.log2(size) - math.log2(rank), abs=1e-12
        )


def test_exposure_by_rank_on_a_bigram_model():
    """A bigram LM over V = 5 words; a 'memorized' canary's transitions get most of the mass."""
    v, length = 5, 4
    canary = (3, 1, 4, 1)
    start = np.full(v, 1.0 / v)
    trans = np.full((v, v), 1.0 / v)

    def log_ppl(s, start, trans):
        return -(
            math.log(start[s[0]]) + sum(math.log(trans[a, b]) for a, b in itertools.pairwise(s))
        )

    secrets = list(itertools.product(range(v), repeat=length))
    size = v**length
    # uniform model: every candidate tied with the canary -> rank (|R| + 1) / 2
    others = [log_ppl(s, start, trans) for s in secrets if s != canary]
    expected = math.log2(size) - math.log2((size + 1) / 2)
    assert exposure_by_rank(log_ppl(canary, start, trans), others) == pytest.approx(expected)
    # memorized: the canary's own path is strictly the most likely -> exposure = log2 |R|
    start_m, trans_m = start.copy(), trans.copy()
    start_m[canary[0]] += 1.0
    for a, b in itertools.pairwise(canary):
        trans_m[a, b] += 1.0
    start_m /= start_m.sum()
    trans_m /= trans_m.sum(1, keepdims=True)
    others = [log_ppl(s, start_m, trans_m) for s in secrets if s != canary]
    assert exposure_by_rank(log_ppl(canary, start_m, trans_m), others) == pytest.approx(
        math.log2(size)
    )


def test_rank_sampling_estimate_approaches_the_exact_value():
    """Candidates a uniform sample of R: the estimated rank scales the share ranked ahead."""
    rng = np.random.default_rng(0)
    size = 10**4
    scores = np.arange(size, dtype=float)  # rank of score k is k + 1
    canary = 299.0  # exact exposure log2(1e4 / 300)
    others = np.delete(scores, 299)
    exact = exposure_by_rank(canary, others)
    assert exact == pytest.approx(math.log2(size / 300))
    sample = rng.choice(others, size=3000, replace=False)
    assert exposure_by_rank(canary, sample, space_size=size) == pytest.approx(exact, abs=0.15)
    # with replacement there may be more samples than other candidates
    small = np.arange(8.0)  # |R| = 8, canary 2.5 ranks 4th: exposure log2(8 / 4)
    sample = rng.choice(np.delete(small, 3), size=20_000, replace=True)
    assert exposure_by_rank(2.5, sample, space_size=8) == pytest.approx(math.log2(8 / 4), abs=0.05)


def test_exposure_by_rank_refuses_bad_input():
    with pytest.raises(ValueError, match="candidate_log_ppls is empty"):
        exposure_by_rank(1.0, [])
    with pytest.raises(ValueError, match="space_size=1 is not allowed"):
        exposure_by_rank(1.0, [0.0, 2.0, 3.0], space_size=1)
    with pytest.raises(ValueError, match="NaN or infinite"):
        exposure_by_rank(1.0, [0.0, float("nan")])
    with pytest.raises(ValueError, match="canary_log_ppl"):
        exposure_by_rank(float("inf"), [0.0])


# -- exposure by the distribution model -------------------------------------------------------


@pytest.mark.parametrize("shape", [-4.0, 0.0, 4.0])
@pytest.mark.parametrize("quantile", [1e-2, 1e-4])
def test_distribution_estimate_recovers_a_known_skew_normal(shape, quantile):
    """Samples from a known skew-normal: exposure ~ -log2 of the canary's true quantile."""
    dist = stats.skewnorm(shape, loc=60.0, scale=9.0)
    samples = dist.rvs(size=4000, random_state=np.random.default_rng(1))
    canary = float(dist.ppf(quantile))
    estimate = exposure_by_distribution(canary, samples)
    # the fitted tail extrapolates: 4000 samples pin a 1e-4 quantile to within ~0.8 bits
    assert estimate == pytest.approx(-math.log2(quantile), rel=0.08)


def test_distribution_estimate_is_close_to_the_exact_rank_exposure():
    """The whole space R scored from a skew-normal; the fit on 2000 random candidates agrees."""
    rng = np.random.default_rng(2)
    size = 50_000
    scores = stats.skewnorm(3.0, loc=40.0, scale=6.0).rvs(size=size, random_state=rng)
    order = np.sort(scores)
    for k in (10, 100, 1000):  # canaries ranked 11th, 101st, 1001st of 50 000
        canary = float(order[k])
        exact = exposure_by_rank(canary, np.delete(order, k))
        estimate = exposure_by_distribution(canary, rng.choice(scores, 2000, replace=False))
        assert estimate == pytest.approx(exact, abs=0.5), k


def test_distribution_estimate_refuses_too_few_or_constant_samples():
    with pytest.raises(ValueError, match="at least 100 random candidates"):
        exposure_by_distribution(0.0, np.arange(50.0))
    with pytest.raises(ValueError, match="all equal"):
        exposure_by_distribution(0.0, np.ones(200))
    with pytest.raises(ValueError, match="all equal"):  # equal up to rounding error
        exposure_by_distribution(0.0, 30.0 + 1e-14 * np.arange(200))
    with pytest.raises(ValueError, match="NaN or infinite"):
        exposure_by_distribution(0.0, [*np.arange(200.0), float("inf")])
    fit = fit_skewnorm(stats.norm.rvs(size=500, random_state=np.random.default_rng(0)))
    assert fit.n_samples == 500 and fit.scale > 0
    # a fit can be reused; a very far canary stays finite (no underflow to inf)
    assert exposure_by_distribution(0.0, fit) == pytest.approx(1.0, abs=0.15)
    assert math.isfinite(exposure_by_distribution(-200.0, fit))


@pytest.mark.parametrize("shape", [-5.0, 0.0, 0.5, 5.0, 20.0])
@pytest.mark.parametrize("z", [-0.5, -3.0, -8.0, -30.0])
def test_skewnorm_logcdf_matches_mpmath(shape, z):
    """log F(z) against high-precision quadrature of 2 phi(t) Phi(a t), far into the tail."""
    mpmath.mp.dps = 50

    def density(t):
        return 2 * mpmath.npdf(t) * mpmath.ncdf(shape * t)

    ref = float(mpmath.log(mpmath.quad(density, [-mpmath.inf, z - 2, z - 0.5, z - 0.1, z])))
    assert skewnorm_logcdf(z, shape) == pytest.approx(ref, rel=1e-5, abs=1e-9)


# -- canaries -------------------------------------------------------------------------------


def test_canaries_are_reproducible_well_formed_and_encodable(tokenizer):
    kw = dict(repetitions=(1, 10, 100), per_repetition=4, subvocab_size=10, secret_length=5)
    a = make_canaries(WORDS, seed=3, tokenizer=tokenizer, **kw)
    b = make_canaries(reversed(WORDS), seed=3, tokenizer=tokenizer, **kw)  # order of words: same
    c = make_canaries(WORDS, seed=4, tokenizer=tokenizer, **kw)
    assert a == b and a != c
    assert len(a.canaries) == 12 and a.space_size == 10**5
    assert a.max_exposure == pytest.approx(5 * math.log2(10))
    assert Counter(x.repetitions for x in a.canaries) == {1: 4, 10: 4, 100: 4}
    assert len(set(a.subvocab)) == 10 and set(a.subvocab) <= set(WORDS)
    assert len({x.prefix for x in a.canaries}) == 12 and len({x.secret for x in a.canaries}) == 12
    for x in a.canaries:
        assert x.secret.split(" ") == list(x.secret_words) and len(x.secret_words) == 5
        assert set(x.secret_words) | set(x.prefix_words) <= set(a.subvocab)
        assert x.prefix == " name : {} | Type : {} | area : {}".format(*x.prefix_words)
        check_encodable(tokenizer, x.pair)  # no [UNK] piece anywhere
        ids = tokenizer(x.secret, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids).strip() == x.secret  # faithful round trip


def test_secret_space_enumeration_and_sampling():
    cs = make_canaries(WORDS, per_repetition=1, repetitions=(1,), subvocab_size=3, secret_length=4)
    secrets = list(cs.all_secrets())
    assert len(secrets) == len(set(secrets)) == cs.space_size == 81
    own = cs.canaries[0].secret
    assert own in secrets
    sample = cs.sample_secrets(500, exclude=own, seed=1)
    assert own not in sample and set(sample) <= set(secrets)
    assert sample == cs.sample_secrets(500, exclude=own, seed=1)
    assert len(set(sample)) > 60  # uniform over the 80 others


def test_subvocabulary_skips_words_the_tokenizer_cannot_encode(tokenizer):
    words = [*WORDS[:10], "z€ro", "n1ne"]  # '€' and '1' never seen by the tokenizer
    cs = make_canaries(words, subvocab_size=10, per_repetition=2, tokenizer=tokenizer)
    assert set(cs.subvocab) == set(WORDS[:10])
    with pytest.raises(ValueError, match="only 10 usable distinct word"):
        make_canaries(words, subvocab_size=11, tokenizer=tokenizer)


def test_unencodable_canary_format_is_refused_naming_the_piece(tokenizer):
    with pytest.raises(ValueError, match=r"cannot be encoded by the tokenizer.*'€'"):
        make_canaries(WORDS, prefix_format=" name € {word}", tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"'7'"):
        check_encodable(tokenizer, ["alpha 7 bravo"])


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        ("name : word", "at least one"),
        ("name : {word} | {area}", "field"),
        ("name : {word", "write"),
    ],
)
def test_bad_prefix_formats_are_refused(fmt, message):
    with pytest.raises(ValueError, match=message):
        make_canaries(WORDS, prefix_format=fmt)


def test_too_many_canaries_for_the_space_is_refused():
    with pytest.raises(ValueError, match="distinct prefixes and secrets"):
        make_canaries(WORDS, subvocab_size=2, secret_length=2, per_repetition=3)


def test_insert_canaries_repeats_each_exactly_r_times():
    pairs = [(f"name[{i}]", f"text {i}") for i in range(50)]
    cs = make_canaries(WORDS, repetitions=(1, 10, 100), per_repetition=3)
    train = insert_canaries(pairs, cs, seed=0)
    counts = Counter(train)
    assert len(train) == 50 + 3 * (1 + 10 + 100)
    for c in cs.canaries:
        assert counts[c.pair] == c.repetitions
    assert all(counts[p] == 1 for p in pairs)
    assert train == insert_canaries(pairs, cs, seed=0) != insert_canaries(pairs, cs, seed=1)
    assert train[:50] != pairs  # shuffled, not appended


def test_candidate_words():
    texts = ["The Eagle is a coffee-shop, near Burger King.", "eagle 42 ok"]
    assert candidate_words(texts) == [
        "Burger",
        "Eagle",
        "King",
        "The",
        "coffee",
        "eagle",
        "near",
        "shop",
    ]
    assert candidate_words(texts, min_chars=2, max_chars=3) == ["The", "is", "ok"]
