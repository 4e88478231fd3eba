"""Canary exposure: the secret-sharer test of unintended memorization (Carlini et al., 2019).

A *canary* is a made-up record ``prefix -> secret`` inserted ``r`` times into
the training data. After training, the model's log-perplexity of the canary's
secret (given its prefix) is compared with the log-perplexities of the other
candidate secrets of the same format. Carlini et al. (2019), §4, define the
**exposure** of a canary with secret ``s`` among the candidates ``R``

    exposure(s) = log2 |R| - log2 rank(s)                                    (Def. 4)

where ``rank(s)`` is the position of ``s`` among all candidates sorted by
log-perplexity (1 = the most likely). Exposure ranges over ``[0, log2 |R|]``;
a canary with exposure near ``log2 |R|`` is the model's first guess and can be
extracted. Li et al. (2022, "Large language models can be strong
differentially private learners", appendix M, Table 9) run this test on E2E:
a sub-vocabulary of ``V = 10`` random words, prefixes
``" name : <word> | Type : <word> | area : <word>"`` and secrets of ``l`` random
sub-vocabulary words, so ``|R| = V**l`` (``log2(10**5) ~ 17``).

This module holds the pure parts (no model):

- :func:`make_canaries`: seeded canaries (sub-vocabulary, prefixes, secrets)
  and their secret space, refused when a tokenizer cannot encode them
  (:func:`check_encodable`);
- :func:`insert_canaries`: each canary repeated ``r`` times in one training set;
- :func:`exposure_by_rank`: Definition 4 from a rank (exact when every other
  candidate is scored, the sampling estimate otherwise);
- :func:`exposure_by_distribution`: Carlini et al.'s §4.3 *approximation by
  distribution model* (a skew-normal fitted to the log-perplexities of random
  candidates), the estimate Li et al. report.

The recipe :mod:`dptrain.recipes.exposure` trains the models and scores the
candidates.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import string
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dptrain._checks import check_finite_array, check_int, check_real

__all__ = [
    "DEFAULT_PREFIX_FORMAT",
    "MIN_DISTRIBUTION_SAMPLES",
    "Canary",
    "CanarySet",
    "SkewNormalFit",
    "candidate_words",
    "check_encodable",
    "exposure_by_distribution",
    "exposure_by_rank",
    "fit_skewnorm",
    "insert_canaries",
    "make_canaries",
    "skewnorm_logcdf",
]

#: Li et al. (2022), appendix M: the canary prefix; every ``{word}`` slot gets a
#: random sub-vocabulary word.
DEFAULT_PREFIX_FORMAT = " name : {word} | Type : {word} | area : {word}"

#: :func:`exposure_by_distribution` refuses fewer random candidates than this:
#: a three-parameter fit to a handful of points says nothing about its tail.
MIN_DISTRIBUTION_SAMPLES = 100

_SLOT = "{word}"
_WORD = re.compile(r"[A-Za-z]+")


# -- canaries --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Canary:
    """One canary: the record ``(prefix, secret)``, inserted ``repetitions`` times.

    ``prefix`` plays the table and ``secret`` the text of a table-to-text pair,
    so the secret is scored given its prefix.
    """

    index: int
    prefix: str
    secret: str
    repetitions: int
    prefix_words: tuple[str, ...]
    secret_words: tuple[str, ...]

    @property
    def pair(self) -> tuple[str, str]:
        """``(prefix, secret)``: the training record."""
        return (self.prefix, self.secret)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prefix": self.prefix,
            "secret": self.secret,
            "repetitions": self.repetitions,
        }


@dataclass(frozen=True)
class CanarySet:
    """Canaries that share a sub-vocabulary, a prefix format and a secret length.

    The secret space ``R`` is every sequence of ``secret_length`` sub-vocabulary
    words (with repetition), joined by single spaces: ``|R| = V ** l``.
    """

    canaries: tuple[Canary, ...]
    subvocab: tuple[str, ...]
    secret_length: int
    prefix_format: str
    seed: int
    repetitions: tuple[int, ...] = field(default=())

    @property
    def space_size(self) -> int:
        """``|R| = V ** l``, the number of candidate secrets."""
        return len(self.subvocab) ** self.secret_length

    @property
    def max_exposure(self) -> float:
        """``log2 |R|``: the exposure of a canary that is the model's first guess."""
        return self.secret_length * math.log2(len(self.subvocab))

    def secret(self, words: Sequence[str]) -> str:
        """The secret string for a sequence of sub-vocabulary words."""
        return " ".join(words)

    def all_secrets(self) -> Iterator[str]:
        """Every candidate secret, in lexicographic order of sub-vocabulary indices."""
        for words in itertools.product(self.subvocab, repeat=self.secret_length):
            yield self.secret(words)

    def sample_secrets(self, n: int, *, exclude: str | None = None, seed: int = 0) -> list[str]:
        """``n`` secrets drawn uniformly from ``R`` (with replacement), never ``exclude``.

        ``exclude`` is the canary's own secret: the distribution model describes
        the *other* candidates.
        """
        n = check_int("n", n, 1)
        if exclude is not None and self.space_size < 2:
            raise ValueError("the secret space has one element: nothing to sample besides it")
        rng = random.Random(seed)
        out: list[str] = []
        while len(out) < n:
            s = self.secret(rng.choices(self.subvocab, k=self.secret_length))
            if s != exclude:
                out.append(s)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "subvocab": list(self.subvocab),
            "secret_length": self.secret_length,
            "prefix_format": self.prefix_format,
            "space_size": self.space_size,
            "max_exposure": self.max_exposure,
            "seed": self.seed,
            "repetitions": list(self.repetitions),
            "canaries": [c.to_dict() for c in self.canaries],
        }


def candidate_words(texts: Iterable[str], *, min_chars: int = 3, max_chars: int = 12) -> list[str]:
    """The distinct alphabetic words of ``texts`` (sorted), to draw a sub-vocabulary from.

    Li et al. draw the ``V`` words from GPT-2's vocabulary; without a pretrained
    vocabulary the recipe draws them from the words of the training texts,
    which a tokenizer trained on those texts encodes faithfully.
    """
    min_chars = check_int("min_chars", min_chars, 1)
    max_chars = check_int("max_chars", max_chars, min_chars)
    words = {w for t in texts for w in _WORD.findall(t) if min_chars <= len(w) <= max_chars}
    return sorted(words)


def _check_prefix_format(prefix_format: str) -> int:
    """The number of ``{word}`` slots; ValueError for any other ``{...}`` field."""
    if not isinstance(prefix_format, str):
        raise ValueError(f"prefix_format={prefix_format!r} is not allowed: expected a string")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(prefix_format) if f is not None]
    except ValueError as err:
        raise ValueError(
            f"prefix_format={prefix_format!r} is not allowed: {err} (write {{word}} for a slot)"
        ) from None
    bad = sorted({f for f in fields if f != "word"})
    if bad:
        raise ValueError(
            f"prefix_format={prefix_format!r} is not allowed: it has field(s) {bad}; "
            "expected only {word} slots"
        )
    if not fields:
        raise ValueError(
            f"prefix_format={prefix_format!r} is not allowed: expected at least one {{word}} slot"
        )
    return len(fields)


def _fill(prefix_format: str, words: Sequence[str]) -> str:
    parts = prefix_format.split(_SLOT)
    return parts[0] + "".join(w + p for w, p in zip(words, parts[1:], strict=True))


def check_encodable(tokenizer: Any, texts: Iterable[str], *, what: str = "canary") -> None:
    """Refuse (``ValueError``) texts the tokenizer can only encode with its unknown token.

    The message names every piece that maps to the unknown token and a text it
    occurs in. An exposure measured on ``[UNK]`` tokens would score a different
    secret than the one inserted.
    """
    from dptrain.data.tokenizer import unknown_pieces

    bad: dict[str, str] = {}
    for text in texts:
        for piece in unknown_pieces(tokenizer, text):
            bad.setdefault(piece, text)
    if bad:
        shown = ", ".join(f"{p!r} (in {t!r})" for p, t in list(bad.items())[:10])
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise ValueError(
            f"the {what} cannot be encoded by the tokenizer: piece(s) {shown}{more} map to its "
            f"unknown token {getattr(tokenizer, 'unk_token', None)!r}; choose a prefix format "
            "and sub-vocabulary made of text the tokenizer knows"
        )


def make_canaries(
    words: Iterable[str],
    *,
    repetitions: Sequence[int] = (1, 10, 100),
    per_repetition: int = 5,
    subvocab_size: int = 10,
    secret_length: int = 5,
    prefix_format: str = DEFAULT_PREFIX_FORMAT,
    seed: int = 0,
    tokenizer: Any = None,
) -> CanarySet:
    """Seeded canaries in Li et al.'s format (appendix M), ``per_repetition`` per value of r.

    Args:
        words: the words to draw the sub-vocabulary from (e.g. :func:`candidate_words`
            of the training texts); duplicates and words with whitespace are dropped.
        repetitions: how often each group of canaries is inserted (``r`` in Table 9).
        per_repetition: canaries per value of ``r``.
        subvocab_size: ``V``, the sub-vocabulary size.
        secret_length: ``l``, words per secret (Li et al.: 5 on average; fixed here so
            that the secret space is exactly ``V ** l``).
        prefix_format: the prefix with ``{word}`` slots, each filled with a random
            sub-vocabulary word.
        seed: the same seed gives the same canaries.
        tokenizer: if given, the sub-vocabulary is drawn only from words it encodes
            faithfully (:func:`~dptrain.data.tokenizer.unknown_pieces` empty for
            ``" " + word``), and every prefix and secret is checked with
            :func:`check_encodable` (a format it cannot encode is an error).

    Every canary has a distinct prefix (so each secret is scored given its own
    context) and a distinct secret. Canaries are numbered in the order of
    ``repetitions``.
    """
    reps = tuple(check_int("repetitions", r, 1) for r in repetitions)
    if not reps:
        raise ValueError("repetitions=() is not allowed: expected at least one value of r")
    per_repetition = check_int("per_repetition", per_repetition, 1)
    subvocab_size = check_int("subvocab_size", subvocab_size, 2)
    secret_length = check_int("secret_length", secret_length, 1)
    seed = check_int("seed", seed, 0)
    n_slots = _check_prefix_format(prefix_format)
    if tokenizer is not None:  # the format's fixed text must encode (slots filled below)
        check_encodable(tokenizer, [prefix_format.replace(_SLOT, "")], what="canary prefix format")

    pool = sorted(
        {w for w in words if isinstance(w, str) and w and not any(c.isspace() for c in w)}
    )
    if tokenizer is not None:
        from dptrain.data.tokenizer import unknown_pieces

        pool = [w for w in pool if not unknown_pieces(tokenizer, " " + w)]
    if len(pool) < subvocab_size:
        raise ValueError(
            f"subvocab_size={subvocab_size} is not allowed: only {len(pool)} usable distinct "
            "word(s) were given" + (" (that the tokenizer encodes)" if tokenizer else "")
        )
    n = len(reps) * per_repetition
    if subvocab_size**n_slots < n or subvocab_size**secret_length < n:
        raise ValueError(
            f"per_repetition={per_repetition} is not allowed: {n} canaries need {n} distinct "
            f"prefixes and secrets, but V={subvocab_size} gives {subvocab_size**n_slots} "
            f"prefixes and {subvocab_size**secret_length} secrets"
        )

    rng = random.Random(seed)
    subvocab = tuple(rng.sample(pool, subvocab_size))
    canaries: list[Canary] = []
    prefixes: set[str] = set()
    secrets: set[str] = set()
    for r in reps:
        for _ in range(per_repetition):
            while True:  # distinct prefixes: two canaries in one context would blur each other
                p_words = tuple(rng.choices(subvocab, k=n_slots))
                prefix = _fill(prefix_format, p_words)
                if prefix not in prefixes:
                    break
            while True:
                s_words = tuple(rng.choices(subvocab, k=secret_length))
                secret = " ".join(s_words)
                if secret not in secrets:
                    break
            prefixes.add(prefix)
            secrets.add(secret)
            canaries.append(Canary(len(canaries), prefix, secret, r, p_words, s_words))
    cs = CanarySet(tuple(canaries), subvocab, secret_length, prefix_format, seed, reps)
    if tokenizer is not None:
        check_encodable(tokenizer, [t for c in canaries for t in c.pair], what="canary")
    return cs


def insert_canaries(
    pairs: Sequence[tuple[str, str]], canaries: CanarySet | Sequence[Canary], *, seed: int = 0
) -> list[tuple[str, str]]:
    """The training pairs with every canary added ``canary.repetitions`` times, shuffled.

    As Carlini et al. (2019) do, all canaries go into one training set; the
    seeded shuffle spreads the copies over the data.
    """
    items = canaries.canaries if isinstance(canaries, CanarySet) else tuple(canaries)
    out = list(pairs)
    for c in items:
        out.extend([c.pair] * c.repetitions)
    random.Random(check_int("seed", seed, 0)).shuffle(out)
    return out


# -- exposure --------------------------------------------------------------------------------


def exposure_by_rank(
    canary_log_ppl: float,
    candidate_log_ppls: Iterable[float],
    space_size: int | None = None,
) -> float:
    """Exposure ``log2 |R| - log2 rank`` (Carlini et al., 2019, Definition 4).

    Args:
        canary_log_ppl: the canary secret's log-perplexity (lower = more likely).
        candidate_log_ppls: log-perplexities of *other* candidate secrets (the
            canary's own secret excluded).
        space_size: ``|R|``. ``None`` means the candidates are all the others,
            ``|R| = len(candidates) + 1``: the rank and the exposure are exact.
            Given, the candidates are a uniform sample of the others (with or
            without replacement, so there may be more of them than ``|R| - 1``)
            and the rank is its estimate ``1 + (|R| - 1) * share ranked ahead``.

    Ties: a candidate with exactly the canary's log-perplexity counts as half a
    candidate ahead of it, i.e. the rank is ``1 + #(lower) + #(tied) / 2``, the
    expected rank when ties are broken at random. The rank is thus in
    ``[1, |R|]`` and the exposure in ``[0, log2 |R|]``.
    """
    x = check_real("canary_log_ppl", canary_log_ppl)
    c = check_finite_array("candidate_log_ppls", candidate_log_ppls)
    if c.size == 0:
        raise ValueError("candidate_log_ppls is empty: exposure needs other candidates")
    size = c.size + 1 if space_size is None else check_int("space_size", space_size, 2)
    ahead = float(np.sum(c < x)) + 0.5 * float(np.sum(c == x))
    rank = 1.0 + (size - 1) * ahead / c.size
    return math.log2(size) - math.log2(rank)


@dataclass(frozen=True)
class SkewNormalFit:
    """A skew-normal distribution (``scipy.stats.skewnorm`` parameters) of log-perplexities."""

    shape: float
    loc: float
    scale: float
    n_samples: int

    def log2_cdf(self, x: float) -> float:
        """``log2 P(X <= x)``, accurate far into the tail."""
        return skewnorm_logcdf((x - self.loc) / self.scale, self.shape) / math.log(2.0)

    def to_dict(self) -> dict[str, float]:
        return {
            "shape": self.shape,
            "loc": self.loc,
            "scale": self.scale,
            "n_samples": self.n_samples,
        }


def fit_skewnorm(
    sampled_log_ppls: Iterable[float], *, min_samples: int = MIN_DISTRIBUTION_SAMPLES
) -> SkewNormalFit:
    """Maximum-likelihood skew-normal fit to the log-perplexities of random candidates.

    Refuses (``ValueError``) fewer than ``min_samples`` samples, samples that are
    all equal (up to rounding) and samples the optimiser cannot fit (e.g. a few
    discrete values).
    The fit runs on standardized values (mean 0, sd 1) for a well-conditioned
    optimisation and is mapped back.
    """
    from scipy import stats

    s = check_finite_array("sampled_log_ppls", sampled_log_ppls)
    min_samples = check_int("min_samples", min_samples, 3)
    if s.size < min_samples:
        raise ValueError(
            f"sampled_log_ppls has {s.size} value(s): the distribution model needs at least "
            f"{min_samples} random candidates (Carlini et al. fit on thousands)"
        )
    mean, sd = float(s.mean()), float(s.std())
    if not sd > 1e-9 * max(1.0, abs(mean)):  # equal up to rounding
        raise ValueError(
            "sampled_log_ppls are all equal: a skew-normal cannot be fitted (the model does "
            "not tell the candidates apart)"
        )
    try:
        shape, loc, scale = stats.skewnorm.fit((s - mean) / sd)
    except stats.FitError as err:  # e.g. a few discrete values: no interior optimum
        raise ValueError(f"the skew-normal fit to sampled_log_ppls failed: {err}") from None
    return SkewNormalFit(float(shape), mean + sd * float(loc), sd * float(scale), int(s.size))


def exposure_by_distribution(
    canary_log_ppl: float,
    sampled_log_ppls: Iterable[float] | SkewNormalFit,
    *,
    min_samples: int = MIN_DISTRIBUTION_SAMPLES,
) -> float:
    """Exposure by the *approximation by distribution model* (Carlini et al., 2019, §4.3).

    Fit a skew-normal to the log-perplexities of random candidate secrets and
    read the rank off its CDF: ``exposure ~ -log2 P(X <= canary_log_ppl)``, the
    rank-based exposure with ``rank / |R|`` replaced by the fitted probability
    that a random candidate is at least as likely as the canary. This is what
    Li et al. (2022) report in Table 9.

    Notes on the approximation: it needs no enumeration of ``R``, but it
    extrapolates the fitted tail, so it is only as good as the skew-normal
    shape far from the samples; it ignores ``|R|`` and can exceed ``log2 |R|``
    (Li et al.'s Table 9 has 17.78 above the ceiling of ~17); and it is near 1
    (not 0) for a canary in the middle of the candidates. Compare it with
    :func:`exposure_by_rank` where ``R`` can be enumerated.

    ``sampled_log_ppls`` may be an existing :class:`SkewNormalFit`.
    """
    x = check_real("canary_log_ppl", canary_log_ppl)
    fit = (
        sampled_log_ppls
        if isinstance(sampled_log_ppls, SkewNormalFit)
        else fit_skewnorm(sampled_log_ppls, min_samples=min_samples)
    )
    return -fit.log2_cdf(x)


def skewnorm_logcdf(z: float, shape: float) -> float:
    """Natural log of the standard skew-normal CDF ``F(z) = 2 int_{-inf}^z phi(t) Phi(a t) dt``.

    scipy's ``skewnorm.logcdf`` underflows to ``-inf`` in the far left tail
    (where a strongly memorized canary lies); there the integral is taken in
    log space: with ``g(t) = log 2 + log phi(t) + log Phi(a t)`` (concave),
    ``log F(z) = g(z) + log int_0^inf exp(g(z - u) - g(z)) du``.
    """
    from scipy import integrate, special, stats

    z = check_real("z", z)
    a = check_real("shape", shape)
    cdf = float(stats.skewnorm.cdf(z, a))
    if cdf > 1e-12:  # the closed form (Owen's T) is accurate away from the far tail
        return math.log(cdf)

    def g(t: float) -> float:
        return math.log(2.0) - 0.5 * t * t - 0.5 * math.log(2 * math.pi) + special.log_ndtr(a * t)

    gz = g(z)
    # g'(z) = -z + a phi(az) / Phi(az) > 0 in the left tail sets the integrand's decay scale;
    # split [0, inf) there so that quad sees where the mass is
    slope = -z + a * math.exp(_log_mills(a * z))
    width = 1.0 / max(slope, 1e-3)
    val, _ = integrate.quad(lambda u: math.exp(g(z - u) - gz), 0.0, 20 * width, limit=200)
    tail, _ = integrate.quad(lambda u: math.exp(g(z - u) - gz), 20 * width, math.inf)
    return gz + math.log(val + tail)


def _log_mills(x: float) -> float:
    """``log(phi(x) / Phi(x))``: d/dx log Phi(x), stable for very negative x."""
    from scipy import special

    return -0.5 * x * x - 0.5 * math.log(2 * math.pi) - float(special.log_ndtr(x))
