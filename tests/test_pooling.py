"""Poolings: plain-loop oracles, padding and permutation invariance over every registered pooling,
finite gradients that never reach padding, single-token sets."""

from __future__ import annotations

import pytest
import torch

from icr.errors import ConfigError
from icr.models.pooling import POOLINGS, positional_encoding

DIM = 6


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _tokens(batch: int = 3, length: int = 5, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """Random features and a mask with sets of 5, 2 and 3 real tokens (the last one not a prefix)."""
    features = torch.randn(batch, length, dim)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0] = True
    mask[1, :2] = True
    mask[2, [0, 2, 4]] = True
    return features, mask


def _real(features: torch.Tensor, mask: torch.Tensor, b: int) -> torch.Tensor:
    return features[b][mask[b]]  # (n, D)


# ---------------------------------------------------------------- plain-loop oracles


def max_loop(features, mask):
    rows = []
    for b in range(features.shape[0]):
        real = _real(features, mask, b)
        rows.append(torch.stack([max(real[:, d]) for d in range(real.shape[1])]))
    return torch.stack(rows)


def mean_loop(features, mask):
    rows = []
    for b in range(features.shape[0]):
        real = _real(features, mask, b)
        rows.append(torch.stack([sum(real[:, d]) / len(real) for d in range(real.shape[1])]))
    return torch.stack(rows)


def _softmax(values: list[torch.Tensor]) -> list[torch.Tensor]:
    exps = [torch.exp(v) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def _sorted_columns(real: torch.Tensor) -> torch.Tensor:
    """Each column sorted descending, by a plain Python sort."""
    columns = [sorted(real[:, d].tolist(), reverse=True) for d in range(real.shape[1])]
    return torch.tensor(columns).t()  # (n, D)


def gpo_loop(module, features, mask):
    rows = []
    for b in range(features.shape[0]):
        real = _real(features, mask, b)
        n = len(real)
        u = _sorted_columns(real)  # (n, D)
        pe = positional_encoding(n, module.pe_dim)[None]  # (1, n, P): no padding, no packing
        out, _ = module.gru(pe)
        half = out.shape[-1] // 2
        scores = module.score((out[0, :, :half] + out[0, :, half:]) / 2)[:, 0]  # (n,)
        weights = _softmax([s / module.temperature for s in scores])
        rows.append(sum(w * u[k] for k, w in enumerate(weights)))
    return torch.stack(rows)


def adpool_loop(module, features, mask):
    weight, bias = module.token_scores.weight, module.token_scores.bias
    rows = []
    for b in range(features.shape[0]):
        real = _real(features, mask, b)
        n, dim = real.shape
        u = _sorted_columns(real)  # (n, D)
        emb, tok = [], []
        for d in range(dim):
            delta = _softmax([real[i, d] for i in range(n)])  # Eq. 4, unsorted
            emb.append(sum(delta[i] * real[i, d] for i in range(n)))
            scores = [torch.relu(weight[d] @ u[k] + bias[d]) for k in range(n)]
            theta = _softmax(scores)  # Eq. 3, per dimension as in the reference code
            tok.append(sum(theta[k] * u[k, d] for k in range(n)))
        t_tok, t_emb = torch.stack(tok), torch.stack(emb)
        w = _softmax([module.balance(t_tok)[0], module.balance(t_emb)[0]])  # Eq. 5
        rows.append(w[0] * t_tok + w[1] * t_emb)
    return torch.stack(rows)


ORACLES = {  # pooling -> its plain loop, (module, features, mask) -> (B, D)
    "max": lambda pool, features, mask: max_loop(features, mask),
    "mean": lambda pool, features, mask: mean_loop(features, mask),
    "gpo": gpo_loop,
    "adpool": adpool_loop,
}


def test_every_registered_pooling_has_a_plain_loop_oracle():
    assert set(POOLINGS.names()) == set(ORACLES)


@pytest.mark.parametrize("name", POOLINGS.names())
def test_pooling_matches_plain_loop(name):
    features, mask = _tokens()
    pool = POOLINGS.bind(name)(DIM)
    with torch.no_grad():
        torch.testing.assert_close(pool(features, mask), ORACLES[name](pool, features, mask),
                                   atol=1e-5, rtol=1e-5)


def test_max_and_mean_by_hand():
    features = torch.tensor([[[1.0, -2.0], [3.0, 5.0], [100.0, 100.0]]])
    mask = torch.tensor([[True, True, False]])
    assert POOLINGS.get("max")(DIM)(features, mask).tolist() == [[3.0, 5.0]]
    assert POOLINGS.get("mean")(DIM)(features, mask).tolist() == [[2.0, 1.5]]


def test_gpo_weights_are_a_softmax_over_the_real_positions():
    features, mask = _tokens()
    pool = POOLINGS.bind("gpo")(DIM)
    sorted_mask = torch.arange(5)[None, :] < mask.sum(1, keepdim=True)
    weights = pool.position_weights(sorted_mask)
    torch.testing.assert_close(weights.sum(1), torch.ones(3))
    assert bool((weights[~sorted_mask] == 0).all())


# ---------------------------------------------------------------- every registered pooling


def _with_garbage(features, mask, extra: int):
    """Garbage in the padded slots and ``extra`` more padded slots, including inf and NaN."""
    batch, _, dim = features.shape
    padded = torch.cat([features, 1e3 * torch.randn(batch, extra, dim)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(batch, extra, dtype=torch.bool)], dim=1)
    padded = padded.masked_fill(~padded_mask[:, :, None], 0.0) + torch.where(
        padded_mask[:, :, None], 0.0, 1e3 * torch.randn_like(padded)
    )
    padded[:, -1, 0] = float("nan")
    padded[:, -1, 1] = float("inf")
    padded[:, -1, 2] = float("-inf")
    return padded, padded_mask


@pytest.mark.parametrize("name", POOLINGS.names())
def test_padding_never_reaches_the_pooled_vector(name):
    features, mask = _tokens()
    pool = POOLINGS.bind(name)(DIM).eval()
    with torch.no_grad():
        clean = pool(features, mask)
        dirty = pool(*_with_garbage(features, mask, extra=4))
    assert torch.isfinite(clean).all()
    torch.testing.assert_close(dirty, clean, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", POOLINGS.names())
def test_pooling_is_invariant_to_token_order(name):
    features, mask = _tokens()
    pool = POOLINGS.bind(name)(DIM).eval()
    perm = torch.randperm(features.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(
            pool(features[:, perm], mask[:, perm]), pool(features, mask), atol=1e-6, rtol=1e-6
        )


@pytest.mark.parametrize("name", POOLINGS.names())
def test_backward_is_finite_and_zero_on_padding(name):
    features, mask = _with_garbage(*_tokens(), extra=2)
    features.requires_grad_(True)
    pool = POOLINGS.bind(name)(DIM)
    pool(features, mask).pow(2).sum().backward()
    assert torch.isfinite(features.grad).all()
    assert bool((features.grad[~mask] == 0).all())
    assert features.grad[mask].abs().sum() > 0
    for param in pool.parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all()


@pytest.mark.parametrize("name", POOLINGS.names())
def test_a_single_token_pools_to_itself(name):
    pool = POOLINGS.bind(name)(DIM).eval()
    single = torch.randn(2, 1, DIM)
    with torch.no_grad():
        torch.testing.assert_close(
            pool(single, torch.ones(2, 1, dtype=torch.bool)), single[:, 0], atol=1e-6, rtol=1e-6
        )
        padded, mask = _with_garbage(single, torch.ones(2, 1, dtype=torch.bool), extra=3)
        torch.testing.assert_close(pool(padded, mask), single[:, 0], atol=1e-6, rtol=1e-6)


def test_a_pooling_rejects_unknown_names_and_options():
    with pytest.raises(ConfigError, match="valid: adpool, gpo, max, mean"):
        POOLINGS.bind("attention")(DIM)
    with pytest.raises(ConfigError, match="pe_dim"):
        POOLINGS.bind("gpo", width=3)(DIM)
    with pytest.raises(ConfigError, match="even"):
        POOLINGS.bind("gpo", pe_dim=5)(DIM)
    assert POOLINGS.bind("gpo", temperature=0.5)(DIM).temperature == 0.5
